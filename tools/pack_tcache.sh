#!/usr/bin/env bash
# Pack the Triton cache this run used into OUT_DIR/tcache.txz.NNofMM (15 MiB parts of an xz
# tar; tcache.tgz.NNofMM, gzip, where the machine has no xz: a device call returns files of at
# most 16 MiB and carries 64 MiB in all, and xz packs the cubins 2.2x smaller than gzip, so a
# whole suite's cache fits beside the FA3 wheel):
#   bash tools/pack_tcache.sh OUT_DIR [--all]
# "Used" means compiled, or read from the carried cache, since tools/device_env.sh unpacked
# it (it dates the unpacked files' access times to 2000, so a read renews one). Entries of
# kernels whose source has changed are never read again, and keeping them grows the cache
# past what a call can return. Where the file system does not record reads (noatime), every
# entry is kept. A run of part of the suite returns only that part; --all keeps every entry
# (carried and new), for such a run: the next whole-suite run prunes again.
# Only what a cache hit loads goes back: the cubin, its metadata and launcher. Triton reads
# a group's files that exist and needs only the binary; the IR levels (.source, .ttir, .ttgir,
# .llir, .ptx) are nine tenths of the bytes and would be read on every load for nothing.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:?usage: pack_tcache.sh OUT_DIR}
[ -d .tcache/triton ] || exit 0
probe=.tcache/.probe
echo probe >"$probe" && touch -a -d 2000-01-01 "$probe" && cat "$probe" >/dev/null
if [ "${2:-}" != --all ] && [ -f .tcache/.unpacked ] && \
        [ "$(stat -c %X "$probe")" -gt 1000000000 ]; then
    mapfile -t dirs < <(find .tcache/triton -mindepth 2 -maxdepth 2 -type f \
        -anewer .tcache/.unpacked -printf '%h\n' | sort -u | sed 's|^\.tcache/||')
else
    dirs=(triton)
fi
total=$(find .tcache/triton -mindepth 1 -maxdepth 1 | wc -l)
if [ "${dirs[*]}" = triton ]; then echo "tcache: all $total entries"
else echo "tcache: ${#dirs[@]} of $total entries"; fi
[ ${#dirs[@]} -gt 0 ] || exit 0
# MM, the part count, in every name: tools/device_env.sh refuses a cache carried short (a
# truncated archive unpacks nothing, and every kernel then compiles cold)
if command -v xz >/dev/null 2>&1; then fmt=txz; squeeze=(xz -T0 -6 -c); else fmt=tgz; squeeze=(gzip -c); fi
rm -f "$out"/tcache.t?z.*
tar cf - -C .tcache --exclude="*.llir" --exclude="*.ttgir" --exclude="*.ttir" \
    --exclude="*.ptx" --exclude="*.source" "${dirs[@]}" | "${squeeze[@]}" \
    | split -b 15M -d - "$out/tcache.$fmt."
parts=("$out"/tcache.$fmt.??)
for part in "${parts[@]}"; do mv "$part" "$part$(printf 'of%02d' ${#parts[@]})"; done
echo "tcache: ${#parts[@]} $fmt parts ($(du -ch "$out"/tcache.$fmt.* | tail -1 | cut -f1))"
