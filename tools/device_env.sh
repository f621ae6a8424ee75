# Sourced from the repository root by the GPU-machine scripts (gpu_suite.sh, sanitize.sh,
# gpu_peers.sh, ncu_blocksparse.sh): a machine without a package index gets the wheels carried
# in .whl/, and the Triton cache carried in .tcache/ (tcache.tgz.NN parts, as gpu_suite.sh
# returns them) is unpacked and used. find_cuda_tool (below) finds ncu or compute-sanitizer.
mkdir -p .tcache
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
# Unpacked once per machine (a script sourced after another skips it). Reads from then on
# renew an entry's access time, which tools/pack_tcache.sh uses to keep only what this run
# compiled or read: the unpacked files are dated to 2000, and .unpacked marks the moment.
if [ ! -f .tcache/.unpacked ]; then
    if ls .tcache/tcache.tgz.* >/dev/null 2>&1; then
        cat .tcache/tcache.tgz.* | tar xzf - -C .tcache
        find .tcache/triton -type f -exec touch -a -d 2000-01-01 {} +
    fi
    # A second early: a read in the same clock tick as this touch still counts as newer.
    touch -d "@$(( $(date +%s) - 1 ))" .tcache/.unpacked
fi
export TRITON_CACHE_DIR=$PWD/.tcache/triton PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1

# find_cuda_tool NAME [PATH...]: prints where the CUDA tool NAME is: on PATH, else the first
# executable of /usr/local/cuda/bin/NAME, /usr/local/cuda-*/bin/NAME and the PATHs given (the
# images install Nsight Compute and compute-sanitizer in places of their own); prints nothing
# where there is none, so the caller says how to set it.
find_cuda_tool() {
    local name=$1 candidate
    shift
    command -v "$name" && return 0
    for candidate in /usr/local/cuda/bin/"$name" /usr/local/cuda-*/bin/"$name" "$@"; do
        if [ -x "$candidate" ]; then
            echo "$candidate"
            return 0
        fi
    done
    return 0
}
