# Sourced from the repository root by the GPU-machine scripts (gpu_suite.sh, sanitize.sh,
# gpu_peers.sh, ncu_blocksparse.sh): a machine without a package index gets the wheels carried
# in .whl/, and the Triton cache carried in .tcache/ (tcache.txz.NNofMM parts, as gpu_suite.sh
# returns them) is unpacked and used. find_cuda_tool (below) finds ncu or compute-sanitizer.
mkdir -p .tcache
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
# Unpacked once per machine (a script sourced after another skips it). Reads from then on
# renew an entry's access time, which tools/pack_tcache.sh uses to keep only what this run
# compiled or read: the unpacked files are dated to 2000, and .unpacked marks the moment.
# Parts named NNofMM (tools/pack_tcache.sh) are checked for all MM; a short set is refused
# loudly (a call that carried two of three parts once compiled the whole suite cold).
unpack_tcache() {
    local fmt parts want found=0
    for fmt in txz tgz; do
        parts=(.tcache/tcache.$fmt.*)
        [ -e "${parts[0]}" ] || continue
        found=1
        want=${parts[0]##*of}
        if [[ ${parts[0]} == *of* ]] && [ ${#parts[@]} -ne $((10#$want)) ]; then
            echo "tcache: INCOMPLETE: ${#parts[@]} of $((10#$want)) $fmt parts carried, none" \
                "unpacked (carry every .tcache/tcache.$fmt.* part); kernels compile cold" >&2
            continue
        fi
        if [ $fmt = tgz ]; then
            cat "${parts[@]}" | tar xzf - -C .tcache
        elif command -v xz >/dev/null 2>&1; then
            cat "${parts[@]}" | xz -dc | tar xf - -C .tcache
        else
            cat "${parts[@]}" | python3 -c "import lzma, shutil, sys
shutil.copyfileobj(lzma.open(sys.stdin.buffer), sys.stdout.buffer)" | tar xf - -C .tcache
        fi || echo "tcache: the $fmt parts did not unpack whole" >&2
    done
    [ $found = 1 ] || return 0
    [ -d .tcache/triton ] && find .tcache/triton -type f -exec touch -a -d 2000-01-01 {} +
    echo "tcache: $(find .tcache/triton -mindepth 1 -maxdepth 1 2>/dev/null | wc -l) entries unpacked"
}
if [ ! -f .tcache/.unpacked ]; then
    unpack_tcache
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
