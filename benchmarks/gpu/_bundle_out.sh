# Sourced by the scripts in benchmarks/gpu/: bundle_out DIR. The device tool returns at most 8 files from $OUT; when DIR
# (under $OUT) holds more, its top-level files go back as one DIR/logs.tgz (the originals removed; subfolders such
# as a profiler trace stay as they are).
bundle_out() {
  local dir=$1
  [ "$(find "$dir" -type f | wc -l)" -gt 8 ] || return 0
  (cd "$dir" && find . -maxdepth 1 -type f ! -name logs.tgz -print0 | tar czf logs.tgz --null -T - --remove-files) \
    && echo "logs: $dir/logs.tgz"
}
