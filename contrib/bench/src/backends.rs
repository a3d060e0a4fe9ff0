//! The backends a run measures: the file itself, vublk and qemu-storage-daemon as named in
//! `--backends`, and the `--variant` syntax that adds configured copies of them (extra
//! options, another image, another vublk build).

use std::path::PathBuf;

use crate::args::Opts;

/// What serves the image.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BackendKind {
    /// No server: libblkio's io_uring driver on the image, O_DIRECT (the limit).
    File,
    Vublk,
    /// qemu-storage-daemon's vhost-user-blk export.
    Qsd,
}

/// A backend as measured: its kind plus any extra options (variants).
#[derive(Clone, Debug)]
pub struct Backend {
    pub name: String,
    pub kind: BackendKind,
    /// vublk: extra arguments; qsd: extra --blockdev options.
    pub extra: Vec<String>,
    /// Serve this image instead of --image (e.g. a qcow2 copy).
    pub image: Option<PathBuf>,
    /// vublk: run this binary instead of --vublk.
    pub binary: Option<PathBuf>,
}

impl Backend {
    pub fn name(&self) -> &str {
        &self.name
    }
}

/// The backends `--backends` names, in its order; panics on a name that is neither built in
/// nor a `--variant`, or on a variant of another kind.
pub fn resolve_backends(opts: &Opts) -> Vec<Backend> {
    let builtin = |name: &str, kind| Backend {
        name: name.to_owned(),
        kind,
        extra: Vec::new(),
        image: None,
        binary: None,
    };
    opts.backends
        .iter()
        .map(|b| match b.as_str() {
            "file" => builtin("file", BackendKind::File),
            "vublk" => Backend {
                extra: opts
                    .vublk_args
                    .split_whitespace()
                    .map(str::to_owned)
                    .collect(),
                ..builtin("vublk", BackendKind::Vublk)
            },
            "qsd" => builtin("qsd", BackendKind::Qsd),
            other => {
                let spec = opts
                    .variants
                    .iter()
                    .find_map(|v| v.strip_prefix(other)?.strip_prefix('='))
                    .unwrap_or_else(|| {
                        panic!("unknown backend {other}: file, vublk, qsd or a --variant")
                    });
                // An RBD image (`@rbd:POOL/IMAGE`), a null disk (`@null:SIZE`) and an NBD URI on a UNIX socket
                // (`@nbd+unix:///EXPORT?socket=PATH`) have colons of their own: the options
                // start at the first colon after the image.
                let image_end = if let Some(i) = spec.find("@rbd:") {
                    Some(i + "@rbd:".len())
                } else if let Some(i) = spec.find("@null:") {
                    // A null disk, `null:SIZE?read-zeroes=off&latency-ns=N`.
                    Some(i + "@null:".len())
                } else {
                    spec.find("?socket=")
                };
                let (kind, args) = match image_end {
                    Some(from) => match spec[from..].find(':') {
                        Some(j) => (&spec[..from + j], &spec[from + j + 1..]),
                        None => (spec, ""),
                    },
                    None => spec.split_once(':').unwrap_or((spec, "")),
                };
                let (kind, image) = match kind.split_once('@') {
                    Some((k, img)) => (k, Some(PathBuf::from(img))),
                    None => (kind, None),
                };
                let (kind, binary) = match kind.split_once('+') {
                    Some((k, bin)) => (k, Some(PathBuf::from(bin))),
                    None => (kind, None),
                };
                match kind {
                    "vublk" => Backend {
                        name: other.to_owned(),
                        kind: BackendKind::Vublk,
                        extra: args.split_whitespace().map(str::to_owned).collect(),
                        image,
                        binary,
                    },
                    "qsd" if binary.is_none() => Backend {
                        name: other.to_owned(),
                        kind: BackendKind::Qsd,
                        extra: vec![args.to_owned()],
                        image,
                        binary: None,
                    },
                    k => panic!("--variant {other}: kind {k} must be vublk or qsd"),
                }
            }
        })
        .collect()
}
