#!/bin/bash
# serve_with_key.sh SERVER-COMMAND...: run an SGLang server with $SGLANG_API_KEY and without the key
# in any command line (`ps` on the node shows those). train_with_sglang.sbatch starts each server
# through it.
#  - The key goes in a --config YAML of mode 0600 in a private directory, removed at exit: SGLang
#    0.5.23 merges that file into its arguments (sglang/srt/server_args.py:683-689).
#  - SGLANG_API_KEY is removed from the server's environment.
#  - SGLang logs its server_args, the key included (sglang/srt/entrypoints/engine.py:311), so the
#    server's output goes through awk, which replaces the key by <redacted>. The key comes from a
#    file, not from awk's argv.
set -o pipefail
[[ -n ${SGLANG_API_KEY:-} ]] || { echo "serve_with_key.sh: SGLANG_API_KEY is not set" >&2; exit 2; }
umask 077
d=$(mktemp -d)
trap 'rm -rf "$d"' EXIT
trap 'exit 143' TERM INT  # the EXIT trap runs on these too (Slurm signals every process of the step)
printf "api-key: '%s'\n" "$SGLANG_API_KEY" >"$d/key.yaml"
printf '%s' "$SGLANG_API_KEY" >"$d/key"
(unset SGLANG_API_KEY && exec "$@" --config "$d/key.yaml") 2>&1 |
    awk 'BEGIN { getline k < ARGV[1]; close(ARGV[1]); ARGV[1] = "" }
         { while (k != "" && (i = index($0, k)) > 0) $0 = substr($0, 1, i - 1) "<redacted>" substr($0, i + length(k))
           print; fflush() }' "$d/key"
