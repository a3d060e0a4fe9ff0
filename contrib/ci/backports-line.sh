#!/usr/bin/env bash
# Print the apt source line for CODENAME-backports on the mirror this machine already uses:
# the URI of the first enabled source for the Debian suite CODENAME (one-line `deb URI SUITE
# ...` in sources.list and sources.list.d/*.list, or deb822 `URIs:`/`Suites:` stanzas in
# sources.list.d/*.sources). Exit 1 when no source names that suite.
#
#   contrib/ci/backports-line.sh CODENAME [APT_DIR]     (APT_DIR: /etc/apt)
set -euo pipefail
codename=$1
apt_dir=${2:-/etc/apt}

uri=""
# One-line format.
for f in "$apt_dir"/sources.list "$apt_dir"/sources.list.d/*.list; do
    [ -f "$f" ] || continue
    uri=$(awk -v s="$codename" '
        $1 == "deb" {
            i = 2
            if ($i ~ /^\[/) { while ($i !~ /\]$/) i++; i++ }   # [options]
            if ($(i + 1) == s) { print $i; exit }
        }' "$f")
    [ -n "$uri" ] && break
done
# deb822 format: stanzas separated by blank lines.
if [ -z "$uri" ]; then
    for f in "$apt_dir"/sources.list.d/*.sources; do
        [ -f "$f" ] || continue
        uri=$(awk -v s="$codename" '
            function flush() {
                if (types ~ /(^| )deb( |$)/ && enabled != "no" && (" " suites " ") ~ (" " s " ") && uris != "") {
                    split(uris, u, " "); print u[1]; found = 1; exit
                }
                types = ""; suites = ""; uris = ""; enabled = ""
            }
            /^[ \t]*#/ { next }
            /^[ \t]*$/ { flush(); next }
            { key = tolower($1); sub(/:$/, "", key); $1 = ""; sub(/^ +/, "")
              if (key == "types") types = $0
              else if (key == "suites") suites = $0
              else if (key == "uris") uris = $0
              else if (key == "enabled") enabled = tolower($0) }
            END { if (!found) flush() }' "$f")
        [ -n "$uri" ] && break
    done
fi
if [ -z "$uri" ]; then
    echo "no apt source for suite $codename under $apt_dir" >&2
    exit 1
fi
echo "deb $uri $codename-backports main"
