# The checkout seen as the installed `batchserve` (its folders linked beside this file), for mypy
# (pyproject.toml's mypy_path) and for tests/gpu/check.sh on a machine where batchserve is not installed.
# A regular package here: as a namespace, mypy resolves batchserve.procs.api.webui to the webui/ folder.
