//! `vublk create`: new raw, qcow2 and parallels images that qemu-img accepts.
//!
//! qcow2 layout written (version 3, refcount order 4): cluster 0 the header (+ extensions and
//! the backing file name), then the refcount table, the refcount blocks covering all of this
//! metadata, and the L1 table (all entries zero: nothing allocated). Parallels: the header,
//! then the BAT (zeroes) up to the data offset.
//!
//! Nothing proportional to the image's size is built in memory: tables that start out as
//! zeroes are made by extending the file, the rest is written a cluster at a time. If the
//! creation fails part-way (a full disk, a file size limit), the file it created is removed.

use std::fs::{File, OpenOptions};
use std::os::unix::fs::FileExt;
use std::path::Path;

use super::qcow2::header::{
    put32, put64, Header, CRYPT_LUKS, EXT_BACKING_FORMAT, EXT_CRYPTO, INCOMPAT_EXTL2,
    MAX_BACKING_NAME,
};
use super::qcow2::{Compression, MAX_L1_BYTES};

/// What to create.
#[derive(Debug, Clone)]
pub struct CreateParams {
    pub qcow2: bool,
    /// A parallels image with this cluster size (qcow2 must be false).
    pub parallels_cluster: Option<u64>,
    pub size_bytes: u64,
    pub cluster_bits: u32,
    pub compression: Compression,
    /// qcow2 extended L2 entries (16-byte L2 entries: 32 subclusters per cluster).
    pub extended_l2: bool,
    /// Backing file name as it will be stored (relative to the new image), and its format.
    pub backing: Option<(String, &'static str)>,
    /// A LUKS volume around raw data.
    pub encrypt: Option<Encrypt>,
}

/// `vublk create --encrypt`: the new volume's parameters and its passphrase.
#[derive(Clone)]
pub struct Encrypt {
    pub params: crate::crypt::format::FormatParams,
    pub passphrase: std::sync::Arc<crate::crypt::SecretBuf>,
}

impl std::fmt::Debug for Encrypt {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Encrypt")
            .field("params", &self.params)
            .field("passphrase", &"<secret>")
            .finish()
    }
}

/// Why an image could not be created.
#[derive(Debug, thiserror::Error)]
pub enum CreateError {
    #[error("{0} already exists; remove it first (vublk create never overwrites)")]
    Exists(String),
    #[error("cannot create {0}")]
    Io(String, #[source] std::io::Error),
    #[error("size must be a positive multiple of 512 bytes")]
    Size,
    #[error("the image needs an L1 table larger than 32 MiB: use larger clusters")]
    TooLarge,
    #[error("{0}")]
    Parallels(String),
    #[error("formatting the LUKS header")]
    Luks(#[source] crate::crypt::LuksError),
}

/// Create `path` as described. Never overwrites; a file this call created is removed again
/// if the creation fails part-way.
pub fn create(path: &Path, p: &CreateParams) -> Result<(), CreateError> {
    let name = path.display().to_string();
    if p.size_bytes == 0 || !p.size_bytes.is_multiple_of(512) {
        return Err(CreateError::Size);
    }
    // Checked before a file exists.
    let parallels = p
        .parallels_cluster
        .map(|c| super::parallels::new_header(p.size_bytes, c))
        .transpose()
        .map_err(CreateError::Parallels)?;
    // An encrypted qcow2 image's LUKS header, before any file exists (measuring the KDF
    // takes a moment; a refusal leaves nothing behind).
    let crypt = match (&p.encrypt, p.qcow2) {
        (Some(e), true) => Some(
            crate::crypt::format::format(&e.params, (*e.passphrase).as_ref())
                .map_err(CreateError::Luks)?,
        ),
        _ => None,
    };
    let layout = p
        .qcow2
        .then(|| {
            let crypt_bytes = crypt.as_ref().map_or(0, |h| h.data_offset);
            Qcow2Layout::new(p.size_bytes, p.cluster_bits, crypt_bytes, p.extended_l2)
        })
        .transpose()?;
    fail_instead_of_dying_at_the_file_size_limit();
    let f = OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(path)
        .map_err(|e| {
            if e.kind() == std::io::ErrorKind::AlreadyExists {
                CreateError::Exists(name.clone())
            } else {
                CreateError::Io(name.clone(), e)
            }
        })?;
    let io = |e| CreateError::Io(name.clone(), e);
    let r = if let Some((header, data_off)) = parallels {
        f.write_all_at(&header, 0)
            .and_then(|()| f.set_len(data_off))
            .map_err(io)
    } else if let Some(layout) = layout {
        write_qcow2(&f, p, &layout, crypt.as_ref()).map_err(io)
    } else if let Some(e) = &p.encrypt {
        crate::crypt::format::format(&e.params, (*e.passphrase).as_ref())
            .map_err(CreateError::Luks)
            .and_then(|h| {
                f.write_all_at(&h.header, 0)
                    .and_then(|()| f.set_len(h.data_offset + p.size_bytes))
                    .map_err(io)
            })
    } else {
        f.set_len(p.size_bytes).map_err(io)
    };
    let r = r.and_then(|()| f.sync_all().map_err(io));
    if r.is_err() {
        // Created by this call (create_new): nothing that existed before is removed.
        drop(f);
        let _ = std::fs::remove_file(path);
    }
    r
}

/// Under a file size limit (RLIMIT_FSIZE), a write past it kills the process (SIGXFSZ) and
/// would leave a part-made image behind; ignored, the write fails with EFBIG instead and the
/// image is removed.
fn fail_instead_of_dying_at_the_file_size_limit() {
    // SAFETY: SIG_IGN installs no handler; nothing in vublk relies on SIGXFSZ.
    unsafe {
        libc::signal(libc::SIGXFSZ, libc::SIG_IGN);
    }
}

/// Where a new qcow2 image's metadata goes, in clusters after the header: an encrypted
/// image's LUKS header, the refcount table, the refcount blocks (16-bit refcounts) that cover
/// all the metadata, then the L1 table.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Qcow2Layout {
    cluster: u64,
    /// Clusters of the LUKS header (0: not encrypted).
    crypt_clusters: u64,
    l1_size: u64,
    l1_clusters: u64,
    rt_clusters: u64,
    rb_clusters: u64,
}

impl Qcow2Layout {
    fn new(
        size_bytes: u64,
        cluster_bits: u32,
        crypt_bytes: u64,
        extended_l2: bool,
    ) -> Result<Self, CreateError> {
        let c = 1u64 << cluster_bits;
        let crypt_clusters = crypt_bytes.div_ceil(c);
        // An L2 table maps a cluster's worth of 8-byte entries, or of 16-byte extended ones.
        let per_l1 = c * (c / if extended_l2 { 16 } else { 8 });
        let l1_size = size_bytes.div_ceil(per_l1);
        if l1_size * 8 > MAX_L1_BYTES {
            return Err(CreateError::TooLarge);
        }
        let l1_clusters = (l1_size * 8).div_ceil(c).max(1);
        // More refcount blocks may need a longer refcount table, which may need more blocks:
        // both only grow, so this settles.
        let per_block = c / 2;
        let (mut rt_clusters, mut rb_clusters) = (1, 1);
        loop {
            let total = 1 + crypt_clusters + rt_clusters + rb_clusters + l1_clusters;
            let rb = total.div_ceil(per_block);
            let rt = (rb * 8).div_ceil(c);
            if (rt, rb) == (rt_clusters, rb_clusters) {
                break;
            }
            (rt_clusters, rb_clusters) = (rt.max(rt_clusters), rb.max(rb_clusters));
        }
        Ok(Qcow2Layout {
            cluster: c,
            crypt_clusters,
            l1_size,
            l1_clusters,
            rt_clusters,
            rb_clusters,
        })
    }

    /// The LUKS header's place (right after the image header).
    fn crypt_offset(&self) -> u64 {
        self.cluster
    }

    fn rt_offset(&self) -> u64 {
        self.cluster * (1 + self.crypt_clusters)
    }

    fn rb_offset(&self) -> u64 {
        self.rt_offset() + self.rt_clusters * self.cluster
    }

    fn l1_offset(&self) -> u64 {
        self.rb_offset() + self.rb_clusters * self.cluster
    }

    /// Clusters of metadata, all with refcount 1.
    fn total_clusters(&self) -> u64 {
        self.l1_offset() / self.cluster + self.l1_clusters
    }
}

/// The qcow2 image in `f`, a cluster at a time; the L1 table (zeroes) by extending the file.
/// With `crypt`, encrypted as QEMU's `encrypt.format=luks`: the LUKS header in clusters of
/// its own, named by the full disk encryption header extension.
fn write_qcow2(
    f: &File,
    p: &CreateParams,
    layout: &Qcow2Layout,
    crypt: Option<&crate::crypt::format::Formatted>,
) -> std::io::Result<()> {
    let c = layout.cluster;
    let mut hdr = vec![0u8; c as usize];
    let mut h = Header::new_v3(p.cluster_bits, p.size_bytes, p.compression);
    if p.extended_l2 {
        h.incompatible_features |= INCOMPAT_EXTL2;
    }
    h.l1_size = layout.l1_size as u32;
    h.l1_table_offset = layout.l1_offset();
    h.refcount_table_offset = layout.rt_offset();
    h.refcount_table_clusters = layout.rt_clusters as u32;
    // Header extensions, then the end marker, then the backing file name.
    let mut pos = h.header_length as usize;
    if let Some(luks) = crypt {
        h.crypt_method = CRYPT_LUKS;
        put32(&mut hdr, pos, EXT_CRYPTO);
        put32(&mut hdr, pos + 4, 16);
        put64(&mut hdr, pos + 8, layout.crypt_offset());
        put64(&mut hdr, pos + 16, luks.data_offset);
        pos += 8 + 16;
        f.write_all_at(&luks.header, layout.crypt_offset())?;
    }
    if let Some((_, fmt)) = &p.backing {
        put32(&mut hdr, pos, EXT_BACKING_FORMAT);
        put32(&mut hdr, pos + 4, fmt.len() as u32);
        hdr[pos + 8..pos + 8 + fmt.len()].copy_from_slice(fmt.as_bytes());
        pos += 8 + fmt.len().next_multiple_of(8);
    }
    pos += 8; // end of extensions: type 0, length 0
    if let Some((name, _)) = &p.backing {
        if name.is_empty() || name.len() > MAX_BACKING_NAME || pos + name.len() > hdr.len() {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                "backing file name too long",
            ));
        }
        h.backing_file_offset = pos as u64;
        h.backing_file_size = name.len() as u32;
        hdr[pos..pos + name.len()].copy_from_slice(name.as_bytes());
    }
    h.write_to(&mut hdr);
    f.write_all_at(&hdr, 0)?;

    let per_cluster = c / 8;
    for k in 0..layout.rt_clusters {
        let mut rt = vec![0u8; c as usize];
        let first = k * per_cluster;
        for i in first..layout.rb_clusters.min(first + per_cluster) {
            put64(
                &mut rt,
                ((i - first) * 8) as usize,
                layout.rb_offset() + i * c,
            );
        }
        f.write_all_at(&rt, layout.rt_offset() + k * c)?;
    }
    let per_block = c / 2;
    for k in 0..layout.rb_clusters {
        let mut rb = vec![0u8; c as usize];
        let first = k * per_block;
        for i in first..layout.total_clusters().min(first + per_block) {
            let at = ((i - first) * 2) as usize;
            rb[at..at + 2].copy_from_slice(&1u16.to_be_bytes());
        }
        f.write_all_at(&rb, layout.rb_offset() + k * c)?;
    }
    f.set_len(layout.l1_offset() + layout.l1_clusters * c)
}

/// What the operator asked `vublk create` for, its options checked (`config::create_request`):
/// the backing file is still to be looked at (`params`).
#[derive(Debug, Clone)]
pub struct CreateRequest {
    /// `--encrypt`: a LUKS volume around the raw data.
    pub encrypt: Option<Encrypt>,
    pub format: super::Format,
    /// None: the backing file's size.
    pub size_bytes: Option<u64>,
    pub cluster: u64,
    pub compression: Compression,
    /// qcow2 extended L2 entries (subclusters).
    pub extended_l2: bool,
    /// As given (qcow2 only: checked).
    pub backing: Option<std::path::PathBuf>,
    pub file: std::path::PathBuf,
}

/// The parameters to create `req` with: its backing file opened and probed (its format
/// recorded, its size the default); the error names the option.
pub fn params(req: &CreateRequest) -> Result<CreateParams, String> {
    let backing = match &req.backing {
        None => None,
        Some(b) => {
            let name = b
                .to_str()
                .filter(|s| !s.is_empty() && s.len() <= 1023)
                .ok_or_else(|| format!("--backing {}: not a usable name", b.display()))?
                .to_owned();
            let dir = req.file.parent().unwrap_or(Path::new("."));
            let resolved = if b.is_absolute() {
                b.clone()
            } else {
                dir.join(b)
            };
            let f = File::open(&resolved).map_err(|e| {
                format!(
                    "--backing {}: cannot open {}: {e}",
                    b.display(),
                    resolved.display()
                )
            })?;
            let fmt = if super::probe(&f) == Some(super::Format::Qcow2) {
                "qcow2"
            } else {
                "raw"
            };
            Some((name, fmt, f))
        }
    };
    let size_bytes = match (req.size_bytes, &backing) {
        (Some(n), _) => n,
        (None, Some((_, "qcow2", f))) => super::qcow2::Qcow2Image::open_read_only(f)
            .map_err(|e| format!("--backing: {}", crate::logging::error_chain(&e)))?
            .size_bytes(),
        (None, Some((_, _, f))) => f.metadata().map_err(|e| format!("--backing: {e}"))?.len(),
        (None, None) => return Err("--size is required (or give --backing)".into()),
    };
    if size_bytes == 0 || size_bytes % 512 != 0 {
        return Err(format!(
            "--size {size_bytes}: must be a positive multiple of 512 bytes"
        ));
    }
    Ok(CreateParams {
        qcow2: req.format == super::Format::Qcow2,
        parallels_cluster: (req.format == super::Format::Parallels).then_some(req.cluster),
        size_bytes,
        cluster_bits: req.cluster.trailing_zeros(),
        compression: req.compression,
        extended_l2: req.extended_l2,
        backing: backing.map(|(n, f, _)| (n, f)),
        encrypt: req.encrypt.clone(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::image::qcow2::Qcow2Image;
    use std::path::PathBuf;

    fn path(tag: &str) -> PathBuf {
        let d = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("target/unit-tmp");
        std::fs::create_dir_all(&d).unwrap();
        let p = d.join(format!("create-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_file(&p);
        p
    }

    #[test]
    fn created_qcow2_opens_and_reads_as_unallocated() {
        let p = path("q");
        let params = CreateParams {
            parallels_cluster: None,
            qcow2: true,
            size_bytes: 10 << 30,
            cluster_bits: 16,
            compression: Compression::Zstd,
            extended_l2: false,
            backing: None,
            encrypt: None,
        };
        create(&p, &params).unwrap();
        let f = File::open(&p).unwrap();
        let q = Qcow2Image::open_read_only(&f).unwrap();
        assert_eq!(q.size_bytes(), 10 << 30);
        assert_eq!(q.compression, Compression::Zstd);
        let mut out = Vec::new();
        q.map(&f, 0, 1 << 20, &mut out).unwrap();
        assert_eq!(
            out,
            vec![crate::image::qcow2::Extent::Unallocated { len: 1 << 20 }]
        );
        assert!(matches!(create(&p, &params), Err(CreateError::Exists(_))));
        std::fs::remove_file(p).unwrap();
    }

    /// The refcount blocks cover every metadata cluster and the refcount table names every
    /// block, at every cluster size, up to the largest L1 table.
    #[test]
    fn qcow2_layouts_cover_their_metadata() {
        for bits in 9..=21 {
            let c = 1u64 << bits;
            for size in [512, 1 << 30, 128 << 30, 1 << 40, 1 << 50, 1 << 60] {
                let Ok(l) = Qcow2Layout::new(size, bits, 0, false) else {
                    assert!(size.div_ceil(c * c / 8) * 8 > MAX_L1_BYTES, "{bits} {size}");
                    continue;
                };
                assert!(l.rb_clusters * (c / 2) >= l.total_clusters(), "{l:?}");
                assert!(l.rt_clusters * (c / 8) >= l.rb_clusters, "{l:?}");
                assert!(l.l1_clusters * c >= l.l1_size * 8, "{l:?}");
            }
        }
        let l = Qcow2Layout::new(128 << 30, 9, 0, false).unwrap();
        assert_eq!(
            (l.rt_clusters, l.rb_clusters, l.l1_clusters),
            (5, 258, 65536)
        );
    }

    /// A parallels BAT larger than QEMU (and vublk) opens is refused, naming the smallest
    /// cluster size that fits.
    #[test]
    fn parallels_bats_are_held_to_the_open_limit() {
        use crate::image::parallels::{min_cluster, new_header};
        assert_eq!(min_cluster(1 << 40), 2560);
        assert!(new_header(1 << 40, 2560).is_ok());
        let e = new_header(1 << 40, 2048).unwrap_err();
        assert!(e.contains("at least 2560 bytes"), "{e}");
        let (h, data_off) = new_header(1 << 40, 4096).unwrap();
        assert_eq!(data_off, (64 + (1u64 << 28) * 4).next_multiple_of(4096));
        assert_eq!(&h[..16], crate::image::parallels::MAGIC_EXT);
    }

    #[test]
    fn backing_name_is_stored() {
        let p = path("b");
        create(
            &p,
            &CreateParams {
                parallels_cluster: None,
                qcow2: true,
                size_bytes: 1 << 20,
                cluster_bits: 16,
                compression: Compression::Zlib,
                extended_l2: false,
                backing: Some(("base.raw".into(), "raw")),
                encrypt: None,
            },
        )
        .unwrap();
        let f = File::open(&p).unwrap();
        let q = Qcow2Image::open_read_only(&f).unwrap();
        assert_eq!(q.backing_file.as_deref(), Some("base.raw"));
        std::fs::remove_file(p).unwrap();
    }

    #[test]
    fn raw_is_sparse_and_sized() {
        let p = path("r");
        create(
            &p,
            &CreateParams {
                parallels_cluster: None,
                qcow2: false,
                size_bytes: 1 << 30,
                cluster_bits: 16,
                compression: Compression::Zlib,
                extended_l2: false,
                backing: None,
                encrypt: None,
            },
        )
        .unwrap();
        let m = std::fs::metadata(&p).unwrap();
        assert_eq!(m.len(), 1 << 30);
        std::fs::remove_file(p).unwrap();
    }
}
