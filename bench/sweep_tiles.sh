#!/usr/bin/env bash
# Tile sweep of fwd_sm80 on the GPU: one process per CUFLASH_SM80_TILES setting, cuflash only.
#   bash bench/sweep_tiles.sh "64:32:8:1:2 64:64:4:2:2" "--d 64 --L 4096,16384"
# (head_dim:block_n:warps:slices:min_blocks, see cuflash/_launch.py _tile_override)
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1
for cfg in $1; do
  # shellcheck disable=SC2086
  CUFLASH_SM80_TILES=$cfg python3 -m cuflash bench --impl cuflash --mode fwd --no-json --budget 0.2 $2 2>&1 \
    | grep -E "^ *bf16|^ *fp16" | sed "s/^/$cfg /"
done
