# Sourced by the scripts in benchmarks/gpu/: one deadline for the whole script (the device tool stops a command at 600 s).
#   limit N       N seconds cut to what is left of $DEADLINE, at least 1 (`timeout 0` would mean no limit at all)
#   time_for WHAT true when at least $MIN_LEFT seconds (default 40) are left; else says that WHAT is skipped
#   by_memory A B A on GPUs of more than 100 GB (H200s), else B (80-GB H100s): a default that must fit the card
#   quiet         a command's output without XLA's stack frames, log lines, slow-compile alarms and HLO dumps
DEADLINE=${DEADLINE:-570}
limit() { local left=$((DEADLINE - SECONDS)); [ "$left" -lt 1 ] && left=1; echo $(($1 < left ? $1 : left)); }
time_for() {
  [ $((DEADLINE - SECONDS)) -ge "${MIN_LEFT:-40}" ] && return 0
  echo "== $1 skipped: $((DEADLINE - SECONDS)) s of DEADLINE=$DEADLINE left"; return 1
}
by_memory() {
  local mem; mem=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits 2>/dev/null | head -1)
  [ "${mem:-0}" -gt 100000 ] && echo "$1" || echo "$2"
}
quiet() { grep -v "^\s*@\|^E1[0-9]*\|^W1[0-9]*\|^\*\*\*\|slow_operation\|Very slow\|^$\|Warning\|warn(\|^\s*%\|^\s*}"; }
