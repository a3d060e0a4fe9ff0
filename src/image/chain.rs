//! Backing chains: a qcow2 image's unallocated clusters read from its backing file (qcow2,
//! parallels or raw, opened read-only, path relative to the image), recursively, to a
//! bounded depth. A parallels layer has no backing file of its own: what it does not hold
//! reads as zeroes.

use std::fs::{File, OpenOptions};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use super::parallels::{ParallelsError, ParallelsImage, ParallelsOptions};
use super::piece::Piece;
use super::qcow2::{Extent, Qcow2Error, Qcow2Image};
use super::ImageError;

/// Longest chain we follow: deeper chains are refused (a loop or a hostile image).
pub const MAX_BACKING_DEPTH: usize = 16;

/// One backing image.
pub struct Layer {
    pub path: PathBuf,
    pub file: File,
    /// None (and no `parallels`): raw.
    pub qcow2: Option<Qcow2Image>,
    /// A parallels image (the backing file of a snapshot taken of a parallels disk).
    pub parallels: Option<ParallelsImage>,
    pub size_bytes: u64,
    /// Its locks (QEMU's for backing files), held while `file` is open.
    pub lock: std::sync::Mutex<super::lock::ImageLock>,
}

impl std::fmt::Debug for Layer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Layer")
            .field("path", &self.path)
            .field("format", &self.format_name())
            .finish()
    }
}

impl Layer {
    /// "qcow2", "parallels" or "raw".
    pub fn format_name(&self) -> &'static str {
        match (&self.qcow2, &self.parallels) {
            (Some(_), _) => "qcow2",
            (None, Some(_)) => "parallels",
            (None, None) => "raw",
        }
    }
}

/// Why a backing chain cannot be opened.
#[derive(Debug, thiserror::Error)]
pub enum ChainError {
    #[error("the image has a backing file ({0}) and --backing none refuses it")]
    Refused(String),
    #[error("backing chain deeper than {MAX_BACKING_DEPTH} (a loop?)")]
    TooDeep,
    #[error("cannot open backing file {0}")]
    Open(PathBuf, #[source] std::io::Error),
    #[error("backing file {0}")]
    Qcow2(PathBuf, #[source] Qcow2Error),
    #[error("backing file {0}")]
    Parallels(PathBuf, #[source] ParallelsError),
    #[error(transparent)]
    Lock(#[from] super::lock::LockError),
}

/// Open the backing chain below an image whose header names `backing` (None: no chain).
pub fn open_chain(
    image: &Path,
    backing: Option<&str>,
    follow: bool,
    direct: bool,
    locking: super::lock::Locking,
) -> Result<Vec<Layer>, ChainError> {
    let mut layers = Vec::new();
    let mut next = backing.map(|b| resolve(image, b));
    if let (Some(p), false) = (&next, follow) {
        return Err(ChainError::Refused(p.display().to_string()));
    }
    while let Some(path) = next.take() {
        if layers.len() >= MAX_BACKING_DEPTH {
            return Err(ChainError::TooDeep);
        }
        let mut o = OpenOptions::new();
        o.read(true);
        if direct {
            o.custom_flags(libc::O_DIRECT);
        }
        let file = o
            .open(&path)
            .map_err(|e| ChainError::Open(path.clone(), e))?;
        let lock = super::lock::lock_file(&file, &path, super::lock::Perms::BACKING, locking)?;
        let format = super::probe(&file);
        let mut parallels = None;
        let (q, size_bytes) = if format == Some(super::Format::Qcow2) {
            let q = Qcow2Image::open_read_only(&file)
                .map_err(|e| ChainError::Qcow2(path.clone(), e))?;
            next = q.backing_file.as_deref().map(|b| resolve(&path, b));
            let size = q.size_bytes();
            (Some(q), size)
        } else if format == Some(super::Format::Parallels) {
            let p = ParallelsImage::open(&file, ParallelsOptions::default())
                .map_err(|e| ChainError::Parallels(path.clone(), e))?;
            let size = p.size_bytes;
            parallels = Some(p);
            (None, size)
        } else {
            let size = file
                .metadata()
                .map_err(|e| ChainError::Open(path.clone(), e))?
                .len();
            (None, size)
        };
        layers.push(Layer {
            path,
            file,
            qcow2: q,
            parallels,
            size_bytes,
            lock: std::sync::Mutex::new(lock),
        });
    }
    Ok(layers)
}

/// A backing name is relative to the directory of the image that names it.
fn resolve(image: &Path, backing: &str) -> PathBuf {
    let b = Path::new(backing);
    if b.is_absolute() {
        b.to_path_buf()
    } else {
        image.parent().unwrap_or(Path::new(".")).join(b)
    }
}

/// Resolve [offset, offset + len) of the top image through the chain into pieces.
pub fn resolve_read(
    top: &Qcow2Image,
    top_file: &File,
    chain: &[Layer],
    offset: u64,
    len: u64,
    scratch: &mut Vec<Extent>,
    out: &mut Vec<Piece>,
) -> Result<(), ImageError> {
    out.clear();
    resolve_in(Some(top), top_file, 0, chain, offset, len, scratch, out)
}

/// Resolve [offset, offset + len) as chain layer `layer` sees it (1: the first backing
/// file, `chain[0]`), which must be a qcow2 image; piece layers are numbered as
/// [`resolve_read`]'s (what a commit job reads of the layer it merges down).
#[allow(clippy::too_many_arguments)]
pub fn resolve_from_layer(
    chain: &[Layer],
    layer: usize,
    offset: u64,
    len: u64,
    scratch: &mut Vec<Extent>,
    out: &mut Vec<Piece>,
) -> Result<(), ImageError> {
    out.clear();
    let l = layer
        .checked_sub(1)
        .and_then(|i| chain.get(i))
        .ok_or(ImageError::Corrupt("no such chain layer"))?;
    let q = l.qcow2.as_ref().ok_or(ImageError::Corrupt(
        "a layer with a backing file that is not qcow2",
    ))?;
    resolve_in(Some(q), &l.file, layer, chain, offset, len, scratch, out)
}

#[allow(clippy::too_many_arguments)]
fn resolve_in(
    q: Option<&Qcow2Image>,
    file: &File,
    layer: usize,
    chain: &[Layer],
    offset: u64,
    len: u64,
    scratch: &mut Vec<Extent>,
    out: &mut Vec<Piece>,
) -> Result<(), ImageError> {
    let Some(q) = q else {
        // Raw layer: identity.
        out.push(Piece::Data {
            layer,
            host_offset: offset,
            len,
        });
        return Ok(());
    };
    q.map(file, offset, len, scratch)?;
    // The recursion needs `scratch` again: take this level's extents out.
    let exts = std::mem::take(scratch);
    let mut pos = offset;
    for e in &exts {
        let n = e.len();
        match *e {
            Extent::Data { host_offset, len } => out.push(Piece::Data {
                layer,
                host_offset,
                len,
            }),
            Extent::Zero { len } => out.push(Piece::Zero { len }),
            Extent::Compressed {
                host_offset,
                compressed_len,
                skip,
                len,
            } => out.push(Piece::Compressed {
                layer,
                host_offset,
                compressed_len,
                skip,
                len,
            }),
            Extent::Unallocated { len } => match chain.get(layer) {
                None => out.push(Piece::Zero { len }),
                Some(below) => {
                    // A backing file smaller than the image reads as zeroes past its end.
                    let inside = below.size_bytes.saturating_sub(pos).min(len);
                    if let (true, Some(p)) = (inside > 0, &below.parallels) {
                        let mut pieces = Vec::new();
                        p.map(pos, inside, &mut pieces);
                        out.extend(pieces.into_iter().map(|piece| match piece {
                            Piece::Data {
                                host_offset, len, ..
                            } => Piece::Data {
                                layer: layer + 1,
                                host_offset,
                                len,
                            },
                            other => other,
                        }));
                    } else if inside > 0 {
                        resolve_in(
                            below.qcow2.as_ref(),
                            &below.file,
                            layer + 1,
                            chain,
                            pos,
                            inside,
                            scratch,
                            out,
                        )?;
                    }
                    if inside < len {
                        out.push(Piece::Zero { len: len - inside });
                    }
                }
            },
        }
        pos += n;
    }
    *scratch = exts;
    Ok(())
}
