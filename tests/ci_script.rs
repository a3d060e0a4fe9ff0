//! `contrib/ci/backports-line.sh`, which `.ci/run` uses to add the backports suite on the
//! mirror the machine is configured with: both apt source formats, options in brackets,
//! disabled stanzas, and no matching source.

use std::path::Path;
use std::process::Command;

fn line(codename: &str, apt: &Path) -> Result<String, String> {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("contrib/ci/backports-line.sh");
    let o = Command::new("bash")
        .arg(script)
        .arg(codename)
        .arg(apt)
        .output()
        .unwrap();
    let out = String::from_utf8_lossy(&o.stdout).trim().to_owned();
    if o.status.success() {
        Ok(out)
    } else {
        Err(String::from_utf8_lossy(&o.stderr).into_owned())
    }
}

#[test]
fn backports_line_follows_the_configured_mirror() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("target/tmp")
        .join(format!("ci-apt-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(dir.join("sources.list.d")).unwrap();
    std::fs::write(
        dir.join("sources.list"),
        "# deb http://commented.example/debian trixie main\n\
         deb [arch=amd64 signed-by=/k.gpg] http://one.example/debian trixie main\n",
    )
    .unwrap();
    assert_eq!(
        line("trixie", &dir).unwrap(),
        "deb http://one.example/debian trixie-backports main"
    );
    std::fs::remove_file(dir.join("sources.list")).unwrap();
    std::fs::write(
        dir.join("sources.list.d/debian.sources"),
        "Types: deb\nURIs: http://off.example/debian\nSuites: trixie\nEnabled: no\n\n\
         # the mirror\nTypes: deb deb-src\nURIs: http://mirror.example/debian http://x\n\
         Suites: trixie trixie-updates\nComponents: main\n",
    )
    .unwrap();
    assert_eq!(
        line("trixie", &dir).unwrap(),
        "deb http://mirror.example/debian trixie-backports main"
    );
    let e = line("bookworm", &dir).unwrap_err();
    assert!(e.contains("no apt source for suite bookworm"), "{e}");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// `contrib/test.sh` on a machine without the tools, run by a user who cannot install them:
/// it stops before testing anything and prints the exact `apt-get install` line.
#[test]
fn test_script_without_packages_names_the_apt_line() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    // A copy of the scripts where any user can read them (the checkout may be in a home
    // directory nobody else may enter).
    let copy = std::env::temp_dir().join(format!("vublk-ci-script-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&copy);
    let bin = copy.join("bin");
    std::fs::create_dir_all(&bin).unwrap();
    std::fs::create_dir_all(copy.join("contrib/ci")).unwrap();
    for f in ["contrib/test.sh", "contrib/ci/backports-line.sh"] {
        std::fs::copy(root.join(f), copy.join(f)).unwrap();
    }
    // A PATH with only what the script itself runs: every tool the tests need is missing.
    for tool in [
        "bash",
        "dirname",
        "ls",
        "sort",
        "sed",
        "id",
        "grep",
        "dpkg-query",
        "cat",
        "awk",
        "mkdir",
        "tee",
        "wc",
    ] {
        for dir in ["/usr/bin", "/bin"] {
            let p = Path::new(dir).join(tool);
            if p.exists() {
                std::os::unix::fs::symlink(&p, bin.join(tool)).unwrap();
                break;
            }
        }
    }
    // SAFETY: geteuid has no preconditions.
    let euid = unsafe { libc::geteuid() };
    let mut cmd = if euid == 0 {
        // As root the script would install; run it as nobody instead.
        let mut c = Command::new("/usr/bin/setpriv");
        c.args(["--reuid=65534", "--regid=65534", "--clear-groups", "bash"]);
        c
    } else {
        Command::new("bash")
    };
    let o = cmd
        .arg(copy.join("contrib/test.sh"))
        .arg("--setup")
        .env_clear()
        .env("PATH", &bin)
        .output()
        .unwrap();
    std::fs::remove_dir_all(&copy).unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(err.contains("missing Debian packages"), "{err}");
    assert!(
        !err.contains("No such file") && !err.contains("not found"),
        "{err}"
    );
    let line = err
        .lines()
        .find(|l| l.contains("apt-get install -y"))
        .unwrap_or_else(|| panic!("no apt-get line: {err}"));
    for pkg in [
        "qemu-system-x86",
        "qemu-utils",
        "nbdkit",
        "ceph-mon",
        "busybox-static",
    ] {
        assert!(line.contains(pkg), "{pkg} missing from {line}");
    }
}
