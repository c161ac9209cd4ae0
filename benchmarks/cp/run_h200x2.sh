#!/bin/bash
# The context-parallel benchmark on 2 GPUs (nvidia-h200-x2), from the repository root; logs and JSON go to $OUT
# (default benchmarks/cp). NVLink multicast stays off (the machine's rules).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD OUT=${OUT:-benchmarks/cp}
set -o pipefail
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > $OUT/gpus.txt 2>&1
nvidia-smi topo -m >> $OUT/gpus.txt 2>&1
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'gpus', torch.cuda.device_count())" | tee $OUT/versions.txt
run() {  # seconds allowed, name, then the bench's arguments
  local limit=$1 name=$2; shift 2
  timeout $limit torchrun --nproc-per-node 2 --master-addr 127.0.0.1 --master-port 29511 -m fagen.distributed.bench \
    --json $OUT/$name.json "$@" 2>&1 | grep -v "^W.*OMP_NUM_THREADS\|^W.*\*\*\*\*\|^W.*run.py.*\] $" | tee $OUT/$name.log
}
# The case: s128k causal d128 bf16, zigzag; first the ring against one GPU at s32k.
run 250 causal-zigzag-s128k --seq 131072 --heads 32 --head-dim 128 --dtype bf16 --mask causal --layout zigzag \
  --check-seq 32768
# The same with the contiguous split (unbalanced under causal: rank 0 skips the block rank 1 computes), forward only.
run 90 causal-contiguous-s128k --seq 131072 --heads 32 --head-dim 128 --dtype bf16 --mask causal \
  --layout contiguous --directions fwd
# No mask, GQA 4:1 (8 K/V heads), checked at s32k too.
run 110 none-gqa4-s128k --seq 131072 --heads 32 --kv-heads 8 --head-dim 128 --dtype bf16 --mask none \
  --layout contiguous --check-seq 32768 --directions fwd
