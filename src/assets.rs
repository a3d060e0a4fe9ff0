//! The files a package installs beside the binary, generated from the same definitions the
//! binary uses, so they cannot drift from it: the man page and shell completions from the
//! clap definitions, and the vhost-user backend descriptor that QEMU's interop
//! specification (docs/interop/vhost-user.rst, "Backend program conventions") lets
//! management tools such as libvirt discover backends by.

use std::io::{self, Write};
use std::path::{Path, PathBuf};

use clap::CommandFactory;

use crate::args::Args;

/// The descriptor for the binary installed at `binary`: its type is the one
/// `--print-capabilities` reports.
pub fn descriptor(binary: &Path) -> serde_json::Value {
    let caps: serde_json::Value =
        serde_json::from_str(crate::config::capabilities_json()).unwrap_or_default();
    serde_json::json!({
        "description": "vublk: vhost-user-blk backend serving raw, qcow2 and parallels images, NBD exports and Ceph RBD images",
        "type": caps["type"],
        "binary": binary.display().to_string(),
    })
}

/// Write `vublk.1.gz`, `completions/{vublk.bash,_vublk,vublk.fish}` and `50-vublk.json`
/// into `dir`; returns the paths written.
pub fn generate(dir: &Path, binary: &Path) -> io::Result<Vec<PathBuf>> {
    std::fs::create_dir_all(dir.join("completions"))?;
    let mut written = Vec::new();

    let mut page = Vec::new();
    clap_mangen::Man::new(Args::command()).render(&mut page)?;
    let man = dir.join("vublk.1.gz");
    let mut gz =
        flate2::write::GzEncoder::new(std::fs::File::create(&man)?, flate2::Compression::best());
    gz.write_all(&page)?;
    gz.finish()?;
    written.push(man);

    use clap_complete::Shell;
    for (shell, name) in [
        (Shell::Bash, "vublk.bash"),
        (Shell::Zsh, "_vublk"),
        (Shell::Fish, "vublk.fish"),
    ] {
        let path = dir.join("completions").join(name);
        let mut f = std::fs::File::create(&path)?;
        clap_complete::generate(shell, &mut Args::command(), "vublk", &mut f);
        written.push(path);
    }

    let path = dir.join("50-vublk.json");
    let mut text = serde_json::to_string_pretty(&descriptor(binary)).map_err(io::Error::other)?;
    text.push('\n');
    std::fs::write(&path, text)?;
    written.push(path);
    Ok(written)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Read;

    #[test]
    fn assets_describe_this_binary() {
        let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("target/unit-tmp")
            .join(format!("assets-{}", std::process::id()));
        let files = generate(&dir, Path::new("/usr/bin/vublk")).unwrap();
        assert_eq!(files.len(), 5);
        let mut page = String::new();
        flate2::read::GzDecoder::new(std::fs::File::open(dir.join("vublk.1.gz")).unwrap())
            .read_to_string(&mut page)
            .unwrap();
        assert!(
            page.starts_with(".ie") || page.contains(".TH vublk"),
            "{page:.200}"
        );
        for opt in ["socket\\-path", "blk\\-file", "log\\-format", "pidfile"] {
            assert!(page.contains(opt), "man page lacks {opt}");
        }
        let bash = std::fs::read_to_string(dir.join("completions/vublk.bash")).unwrap();
        assert!(bash.contains("--socket-path") && bash.contains("--blk-file"));
        let d: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(dir.join("50-vublk.json")).unwrap())
                .unwrap();
        let caps: serde_json::Value =
            serde_json::from_str(crate::config::capabilities_json()).unwrap();
        assert_eq!(d["type"], caps["type"]);
        assert_eq!(d["type"], "block");
        assert_eq!(d["binary"], "/usr/bin/vublk");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
