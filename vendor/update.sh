#!/usr/bin/env bash
# Rebuild vendor/NAME from NAME's crates.io release and the patches in vendor/patches/NAME/
# (vendor/PATCHES.md says what each patch does and why).
#
#   bash vendor/update.sh [NAME...]          rebuild the crates of vendor/crates.txt in place
#   bash vendor/update.sh --check [NAME...]  rebuild them in a temporary directory and fail,
#                                            with a summary of the differences, if vendor/ is
#                                            not exactly that (CI runs this)
#   bash vendor/update.sh --test [NAME...]   rebuild them in a temporary directory and run each
#                                            crate's own tests there (its dev-dependencies come
#                                            from crates.io; CARGO_TARGET_DIR is honoured)
#
# vendor/NAME is, file for file:
#   1. the contents of NAME-VERSION.crate: the files as published, with the Cargo.toml that
#      crates.io normalized, the author's Cargo.toml.orig, the crate's Cargo.lock and
#      .cargo_vcs_info.json (the upstream commit the release was made from: where the
#      patches go when they are sent upstream); nothing is left out, so nothing needs a rule;
#   2. plus the files in vendor/licenses/NAME/, the license files that the release lacks;
#   3. with vendor/patches/NAME/*.patch applied in the order of their names (git apply: a
#      patch that does not apply exactly fails the run).
# No .cargo-checksum.json: cargo reads these crates as path dependencies
# ([patch.crates-io] in Cargo.toml and fuzz/Cargo.toml), which it does not checksum.
#
# The .crate file is taken from cargo's registry cache ($CARGO_HOME/registry/cache/*/), which
# a `cargo fetch` fills, else downloaded from crates.io with curl; either way its sha256 must
# be the one in vendor/crates.txt.
#
# --check also checks that the [patch.crates-io] tables of Cargo.toml and fuzz/Cargo.toml
# (the fuzz crate is a workspace of its own, so it needs its own table) name exactly the
# crates of vendor/crates.txt, each at its folder here.
#
# To change a patch or bump a crate: see "Changing a patch" in vendor/PATCHES.md.
set -euo pipefail
shopt -s inherit_errexit

vendor="$(cd "$(dirname "$0")" && pwd)"
root="$(dirname "$vendor")"

mode=update
case "${1:-}" in
--check) mode=check; shift ;;
--test) mode=test; shift ;;
-h | --help) sed -n '2,/^set -euo/{/^set -euo/d;s/^# \{0,1\}//;p}' "$0"; exit 0 ;;
-*) echo "update.sh: unknown option $1 (try --help)" >&2; exit 2 ;;
esac

declare -A version sha256 features
crates=()
while read -r name ver sum feat; do
	[[ -z "$name" || "$name" == \#* ]] && continue
	crates+=("$name")
	version[$name]=$ver
	sha256[$name]=$sum
	features[$name]=$feat
done <"$vendor/crates.txt"

selected=("$@")
[ ${#selected[@]} -gt 0 ] || selected=("${crates[@]}")
for name in "${selected[@]}"; do
	[ -n "${version[$name]:-}" ] || { echo "update.sh: $name is not in vendor/crates.txt" >&2; exit 2; }
done

tmp="$(mktemp -d "${TMPDIR:-/tmp}/vublk-vendor.XXXXXX")"
trap 'rm -rf "$tmp"' EXIT

# The release of `name`, checked: prints the path of its .crate file.
fetch_crate() {
	local name=$1 file="$1-${version[$1]}.crate" crate=""
	local cache
	for cache in "${CARGO_HOME:-$HOME/.cargo}"/registry/cache/*/"$file"; do
		[ -f "$cache" ] && { crate=$cache; break; }
	done
	if [ -z "$crate" ]; then
		echo "update.sh: $file is not in cargo's registry cache: downloading it from crates.io" >&2
		crate="$tmp/$file"
		curl -fsSL --retry 3 -o "$crate" "https://static.crates.io/crates/$name/$file"
	fi
	local sum
	sum="$(sha256sum "$crate" | cut -d' ' -f1)"
	if [ "$sum" != "${sha256[$name]}" ]; then
		echo "update.sh: $crate has sha256 $sum, vendor/crates.txt says ${sha256[$name]}" >&2
		return 1
	fi
	echo "$crate"
}

# Build vendor/NAME's tree afresh in $tmp/NAME.
build() {
	local name=$1 crate tree="$tmp/$1"
	crate="$(fetch_crate "$name")"
	mkdir "$tmp/unpack-$name"
	tar -xzf "$crate" -C "$tmp/unpack-$name" --no-same-owner
	mv "$tmp/unpack-$name/$name-${version[$name]}" "$tree"
	rmdir "$tmp/unpack-$name"
	if [ -d "$vendor/licenses/$name" ]; then
		cp -- "$vendor/licenses/$name"/* "$tree/"
	fi
	local patch
	for patch in "$vendor/patches/$name"/*.patch; do
		[ -f "$patch" ] || continue
		# Outside any repository (the ceiling stops git from looking above $tmp), git apply
		# patches the files of the current directory.
		if ! (cd "$tree" && GIT_CEILING_DIRECTORIES="$tmp" git apply "$patch"); then
			echo "update.sh: ${patch#"$root"/} does not apply to $name ${version[$name]}" >&2
			return 1
		fi
	done
}

# Does the [patch.crates-io] table of `manifest` name exactly the crates here, at `prefix`?
check_patch_table() {
	local manifest=$1 prefix=$2 expected actual
	expected="$(for name in "${crates[@]}"; do
		echo "$name = { path = \"$prefix/$name\" }"
	done | sort)"
	actual="$(awk '/^\[/ { table = $0; next } table == "[patch.crates-io]" && NF' \
		"$root/$manifest" | grep -v '^#' | sort)"
	if [ "$expected" != "$actual" ]; then
		echo "update.sh: $manifest's [patch.crates-io] is not the crates of vendor/crates.txt:" >&2
		diff <(echo "$expected") <(echo "$actual") | sed 's/^/  /' >&2 || true
		return 1
	fi
}

failed=0
for name in "${selected[@]}"; do
	build "$name"
	case $mode in
	update)
		rm -rf "${vendor:?}/$name"
		mv "$tmp/$name" "$vendor/$name"
		echo "vendor/$name: rebuilt from ${version[$name]}, patches applied: $(find "$vendor/patches/$name" -name '*.patch' 2>/dev/null | wc -l)"
		;;
	check)
		# target/: a build inside vendor/NAME (ignored by git, so never committed).
		if diff -rq -x target "$vendor/$name" "$tmp/$name" >"$tmp/summary" 2>&1; then
			echo "vendor/$name: the crates.io release of ${version[$name]} with its patches"
		else
			echo "vendor/$name differs from ${version[$name]} with vendor/patches/$name (update.sh --check):" >&2
			sed -e "s|$tmp/$name|rebuilt|g" -e "s|$vendor/|vendor/|g" -e 's/^/  /' "$tmp/summary" >&2
			diff -ru -x target "$vendor/$name" "$tmp/$name" | sed -e "s|$tmp/$name|rebuilt|g" -e "s|$vendor/|vendor/|g" |
				head -n 60 | sed 's/^/  | /' >&2 || true
			echo "  Turn a change of vendor/$name into a patch, or run bash vendor/update.sh $name" >&2
			failed=1
		fi
		;;
	test)
		args=(--locked)
		[ "${features[$name]}" = - ] || args+=(--features "${features[$name]}")
		echo "== $name ${version[$name]} with its patches: cargo test ${args[*]}"
		(cd "$tmp/$name" && cargo test "${args[@]}") || failed=1
		;;
	esac
done

if [ "$mode" = check ]; then
	for dir in "$vendor"/*/; do
		dir="$(basename "$dir")"
		case $dir in patches | licenses) continue ;; esac
		[ -n "${version[$dir]:-}" ] || { echo "update.sh: vendor/$dir is not in vendor/crates.txt" >&2; failed=1; }
	done
	check_patch_table Cargo.toml vendor || failed=1
	check_patch_table fuzz/Cargo.toml ../vendor || failed=1
fi
exit $failed
