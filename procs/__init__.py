"""batchserve's `procs/` folder, installed and imported as `batchserve.procs` (procs/DESIGN.md, "Layout")."""

if __name__ != "batchserve.procs":
    # Found as a top-level `procs` through the working directory on sys.path (`python -m` in a checkout):
    # it would shadow any installed package of that name (Hugging Face's `kernels`, which transformers imports).
    raise ImportError(
        f"{__file__} is batchserve.procs; run Python with -P "
        f"(or from outside the checkout) to import an installed 'procs'"
    )
