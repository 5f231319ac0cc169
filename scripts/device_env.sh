# Sourced by the device scripts (from the repository root): unbuffered output, this tree on
# PYTHONPATH, and the wheels carried in .whl/ (optuna and its dependencies: the lent GPU machine
# has no package index) installed into /tmp/site.
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=$PYTHONPATH:/tmp/site
fi
