"""batchserve's `shared/` folder, installed and imported as `batchserve.shared` (procs/DESIGN.md, "Layout")."""

if __name__ != "batchserve.shared":
    # Found as a top-level `shared` through the working directory on sys.path (`python -m` in a checkout):
    # it would shadow any installed package of that name (Hugging Face's `kernels`, which transformers imports).
    raise ImportError(
        f"{__file__} is batchserve.shared; run Python with -P "
        f"(or from outside the checkout) to import an installed 'shared'"
    )
