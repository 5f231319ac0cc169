# Sourced by the GPU scripts (from the repository root): unbuffered output, this tree on
# PYTHONPATH, and any wheels copied into .whl/ (optuna and its dependencies, for a GPU machine
# without a package index) installed into /tmp/site.
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=$PYTHONPATH:/tmp/site
fi
