#!/usr/bin/env bash
# Nsight Compute on the d128 bf16 s16k backward (issue 28): cuDNN's, fagen's Triton (deterministic) and, when given,
# other --impl values of lab/hopper_profile.py. One launch each after a warm-up; prints one table (lab/ncu_table.py).
# Usage (GPU machine, repo root): bash lab/ncu_bwd.sh [mask] [impl ...]   e.g. bash lab/ncu_bwd.sh causal cudnn-bwd triton-bwd
set -uo pipefail
mask=${1:-causal}; shift || true
impls=${*:-cudnn-bwd triton-bwd}
M="gpu__time_duration.sum,launch__registers_per_thread,launch__grid_size,launch__block_size,"
M+="sm__throughput.avg.pct_of_peak_sustained_elapsed,"
M+="sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active,"
M+="sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active,"
M+="smsp__sass_inst_executed_op_shared_ld.sum,smsp__sass_inst_executed_op_shared_st.sum,"
M+="smsp__sass_inst_executed_op_local_ld.sum,smsp__sass_inst_executed_op_local_st.sum,"
M+="l1tex__data_pipe_lsu_wavefronts_mem_shared.sum,dram__bytes.sum,"
M+="smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio,"
M+="smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio,"
M+="smsp__average_warps_issue_stalled_math_pipe_throttle_per_issue_active.ratio,"
M+="smsp__average_warps_issue_stalled_wait_per_issue_active.ratio,"
M+="smsp__average_warps_issue_stalled_short_scoreboard_per_issue_active.ratio,"
M+="smsp__average_warps_issue_stalled_mio_throttle_per_issue_active.ratio,"
M+="smsp__average_warps_issue_stalled_lg_throttle_per_issue_active.ratio,"
M+="smsp__average_warps_issue_stalled_not_selected_per_issue_active.ratio,"
M+="smsp__average_warps_issue_stalled_selected_per_issue_active.ratio,"
M+="smsp__average_warps_issue_stalled_dispatch_stall_per_issue_active.ratio,"
M+="smsp__average_warps_issue_stalled_membar_per_issue_active.ratio,"
M+="smsp__average_warps_issue_stalled_sleeping_per_issue_active.ratio,"
M+="smsp__average_warps_issue_stalled_no_instruction_per_issue_active.ratio,"
M+="smsp__average_warps_issue_stalled_imc_miss_per_issue_active.ratio,"
M+="smsp__average_warps_issue_stalled_drain_per_issue_active.ratio,"
M+="smsp__average_warps_issue_stalled_branch_resolving_per_issue_active.ratio,"
M+="smsp__average_warps_issue_stalled_misc_per_issue_active.ratio,"
M+="smsp__average_warps_issue_stalled_tex_throttle_per_issue_active.ratio"
for impl in $impls; do
  timeout ${NCU_TIMEOUT:-150} ncu --clock-control none --profile-from-start off --metrics "$M" --csv --page raw \
    python3 lab/hopper_profile.py --impl "$impl" --mask "$mask" --launches 1 > "/tmp/ncu-$impl.csv" 2> "/tmp/ncu-$impl.err"
  echo "ncu $impl exit $?"; grep -i "error\|warn" "/tmp/ncu-$impl.err" | head -3
done
python3 lab/ncu_table.py $(for impl in $impls; do echo "/tmp/ncu-$impl.csv"; done)
