# Sourced by the evidence scripts (validation/hybrid_evidence.sh, validation/optim_evidence.sh):
# run NAME OVERRIDES... trains one run into $out/NAME with "$bin" train "${common[@]}", its log in
# $out/NAME.log; skipped when ONLY is set and does not name it, or when its log has a "done" line;
# resumed from its latest checkpoint when it has one; each call cut at RUN_TIMEOUT seconds.
run() {  # name, then overrides
  local name=$1
  shift
  if [ -n "${ONLY:-}" ] && [[ " $ONLY " != *" $name "* ]]; then return 0; fi
  if grep -qs '^done' "$out/$name.log"; then echo "== $name: done already"; return 0; fi
  local resume=()
  if [ -d "$out/$name/checkpoints" ] && ls "$out/$name/checkpoints" | grep -q step_; then
    resume=(--resume "$out/$name")
  fi
  echo "== $name: $* ${resume[*]}"
  local t0=$SECONDS
  timeout "${RUN_TIMEOUT:-86400}" "$bin" train "${common[@]}" train.out_dir="$out/$name" "$@" \
    "${resume[@]}" >>"$out/$name.log" 2>&1
  local rc=$?
  echo "   exit $rc, $((SECONDS - t0)) s, $(grep -E '^done' "$out/$name.log" || tail -1 "$out/$name.log")"
}
