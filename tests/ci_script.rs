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
