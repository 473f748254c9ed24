#!/usr/bin/env bash
# Fail when a tracked C++/CUDA source differs from its clang-format layout (.clang-format: Google
# style, 100 columns). usage: scripts/check_format.sh [--fix]   (--fix rewrites the files instead)
set -euo pipefail
cd "$(dirname "$0")/.."
command -v clang-format >/dev/null || { echo "check_format: clang-format not found (scripts/setup.sh installs it)" >&2; exit 2; }
mapfile -t files < <(git ls-files '*.cpp' '*.hpp' '*.cu' '*.cuh')
if [ "${1:-}" = "--fix" ]; then
  clang-format -i "${files[@]}"
  exit 0
fi
bad=()
for f in "${files[@]}"; do
  clang-format --dry-run -Werror "$f" >/dev/null 2>&1 || bad+=("$f")
done
if [ ${#bad[@]} -gt 0 ]; then
  echo "check_format: ${#bad[@]} file(s) not clang-formatted ($(clang-format --version | head -1)):" >&2
  printf '  %s\n' "${bad[@]}" >&2
  echo "run scripts/check_format.sh --fix" >&2
  exit 1
fi
echo "check_format: ${#files[@]} files clang-formatted"
