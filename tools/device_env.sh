# Sourced from the repository root by the GPU-machine scripts (gpu_suite.sh, sanitize.sh):
# a machine without a package index gets the wheels carried in .whl/, and the Triton cache
# carried in .tcache/ (tcache.tgz.NN parts, as gpu_suite.sh returns them) is unpacked and used.
mkdir -p .tcache
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
if ls .tcache/tcache.tgz.* >/dev/null 2>&1; then cat .tcache/tcache.tgz.* | tar xzf - -C .tcache; fi
export TRITON_CACHE_DIR=$PWD/.tcache/triton PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1
