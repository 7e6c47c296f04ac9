# Sourced by the GPU session scripts: one deadline for the whole script (the device tool stops a command at 600 s).
#   limit N       N seconds cut to what is left of $DEADLINE, at least 1 (`timeout 0` would mean no limit at all)
#   time_for WHAT true when at least $MIN_LEFT seconds (default 40) are left; else says that WHAT is skipped
DEADLINE=${DEADLINE:-570}
limit() { local left=$((DEADLINE - SECONDS)); [ "$left" -lt 1 ] && left=1; echo $(($1 < left ? $1 : left)); }
time_for() {
  [ $((DEADLINE - SECONDS)) -ge "${MIN_LEFT:-40}" ] && return 0
  echo "== $1 skipped: $((DEADLINE - SECONDS)) s of DEADLINE=$DEADLINE left"; return 1
}
