//! `vublk create`: new raw, qcow2 and parallels images that qemu-img accepts.
//!
//! qcow2 layout written (version 3, refcount order 4): cluster 0 header (+ extensions and the
//! backing file name), cluster 1 the refcount table, cluster 2 the first refcount block,
//! clusters 3.. the L1 table (all entries zero: nothing allocated).

use std::fs::{File, OpenOptions};
use std::io::Write;
use std::os::unix::fs::FileExt;
use std::path::Path;

use super::qcow2::header::{put32, put64, Header, EXT_BACKING_FORMAT, MAX_BACKING_NAME};
use super::qcow2::Compression;

/// What to create.
#[derive(Debug, Clone)]
pub struct CreateParams {
    pub qcow2: bool,
    /// A parallels image with this cluster size (qcow2 must be false).
    pub parallels_cluster: Option<u64>,
    pub size_bytes: u64,
    pub cluster_bits: u32,
    pub compression: Compression,
    /// Backing file name as it will be stored (relative to the new image), and its format.
    pub backing: Option<(String, &'static str)>,
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
}

/// Create `path` as described. Never overwrites.
pub fn create(path: &Path, p: &CreateParams) -> Result<(), CreateError> {
    let name = path.display().to_string();
    if p.size_bytes == 0 || p.size_bytes % 512 != 0 {
        return Err(CreateError::Size);
    }
    let mut f = OpenOptions::new()
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
    let r = if let Some(cluster) = p.parallels_cluster {
        super::parallels::new_image(p.size_bytes, cluster)
            .map_err(CreateError::Parallels)
            .and_then(|b| {
                f.write_all(&b)
                    .map_err(|e| CreateError::Io(name.clone(), e))
            })
    } else if p.qcow2 {
        write_qcow2(&mut f, p)
    } else {
        f.set_len(p.size_bytes)
            .map_err(|e| CreateError::Io(name.clone(), e))
    };
    if r.is_err() {
        let _ = std::fs::remove_file(path);
    }
    r?;
    f.sync_all().map_err(|e| CreateError::Io(name, e))
}

fn write_qcow2(f: &mut File, p: &CreateParams) -> Result<(), CreateError> {
    let io = |e| CreateError::Io("the qcow2 image".into(), e);
    let c = 1u64 << p.cluster_bits;
    let l2_entries = c / 8;
    let per_l1 = c * l2_entries;
    let l1_size = p.size_bytes.div_ceil(per_l1);
    if l1_size * 8 > 32 << 20 {
        return Err(CreateError::TooLarge);
    }
    let l1_clusters = (l1_size * 8).div_ceil(c).max(1);
    let refcount_table = c;
    let refcount_block = 2 * c;
    let l1_offset = 3 * c;
    let total_clusters = 3 + l1_clusters;
    // One 16-bit refcount block covers c / 2 clusters; metadata fits in the first.
    if total_clusters > c / 2 {
        return Err(CreateError::TooLarge);
    }

    let mut hdr = vec![0u8; c as usize];
    let mut h = Header::new_v3(p.cluster_bits, p.size_bytes, p.compression);
    h.l1_size = l1_size as u32;
    h.l1_table_offset = l1_offset;
    h.refcount_table_offset = refcount_table;
    h.refcount_table_clusters = 1;
    // Header extensions, then the end marker, then the backing file name.
    let mut pos = h.header_length as usize;
    if let Some((_, fmt)) = &p.backing {
        put32(&mut hdr, pos, EXT_BACKING_FORMAT);
        put32(&mut hdr, pos + 4, fmt.len() as u32);
        hdr[pos + 8..pos + 8 + fmt.len()].copy_from_slice(fmt.as_bytes());
        pos += 8 + fmt.len().next_multiple_of(8);
    }
    pos += 8; // end of extensions: type 0, length 0
    if let Some((name, _)) = &p.backing {
        if name.is_empty() || name.len() > MAX_BACKING_NAME || pos + name.len() > hdr.len() {
            return Err(CreateError::Io(
                "the qcow2 image".into(),
                std::io::Error::new(
                    std::io::ErrorKind::InvalidInput,
                    "backing file name too long",
                ),
            ));
        }
        h.backing_file_offset = pos as u64;
        h.backing_file_size = name.len() as u32;
        hdr[pos..pos + name.len()].copy_from_slice(name.as_bytes());
    }
    h.write_to(&mut hdr);
    f.write_all(&hdr).map_err(io)?;

    let mut rt = vec![0u8; c as usize];
    put64(&mut rt, 0, refcount_block);
    f.write_all_at(&rt, refcount_table).map_err(io)?;

    let mut rb = vec![0u8; c as usize];
    for i in 0..total_clusters as usize {
        rb[i * 2..i * 2 + 2].copy_from_slice(&1u16.to_be_bytes());
    }
    f.write_all_at(&rb, refcount_block).map_err(io)?;

    let l1 = vec![0u8; (l1_clusters * c) as usize];
    f.write_all_at(&l1, l1_offset).map_err(io)?;
    f.flush().map_err(io)
}

/// Validate `vublk create` arguments into parameters; the error names the option.
pub fn params_from_args(a: &crate::args::CreateArgs) -> Result<CreateParams, String> {
    use crate::args::{parse_size, CompressionArg, Format};
    let qcow2 = a.format == Format::Qcow2;
    let cs = a
        .cluster_size
        .as_deref()
        .unwrap_or(if a.format == Format::Parallels {
            "1M"
        } else {
            "64K"
        });
    let cluster = if a.format == Format::Parallels {
        parse_size(cs)
            .filter(|c| *c > 0 && c % 512 == 0 && *c <= 1 << 30)
            .ok_or_else(|| format!("--cluster-size {cs}: must be a multiple of 512 up to 1G"))?
    } else {
        parse_size(cs)
            .filter(|c| c.is_power_of_two() && (512..=2 << 20).contains(c))
            .ok_or_else(|| format!("--cluster-size {cs}: must be a power of two from 512 to 2M"))?
    };
    if a.format == Format::Parallels && a.backing.is_some() {
        return Err("--backing needs --format qcow2".into());
    }
    let backing = match &a.backing {
        None => None,
        Some(_) if !qcow2 => return Err("--backing needs --format qcow2".into()),
        Some(b) => {
            let name = b
                .to_str()
                .filter(|s| !s.is_empty() && s.len() <= 1023)
                .ok_or_else(|| format!("--backing {}: not a usable name", b.display()))?
                .to_owned();
            let dir = a.file.parent().unwrap_or(Path::new("."));
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
    let size_bytes = match &a.size {
        Some(s) => {
            parse_size(s).ok_or_else(|| format!("--size {s}: expected e.g. 8G, 512M or bytes"))?
        }
        None => match &backing {
            Some((_, "qcow2", f)) => super::qcow2::Qcow2Image::open_read_only(f)
                .map_err(|e| format!("--backing: {}", crate::logging::error_chain(&e)))?
                .size_bytes(),
            Some((_, _, f)) => f.metadata().map_err(|e| format!("--backing: {e}"))?.len(),
            None => return Err("--size is required (or give --backing)".into()),
        },
    };
    if size_bytes == 0 || size_bytes % 512 != 0 {
        return Err(format!(
            "--size {size_bytes}: must be a positive multiple of 512 bytes"
        ));
    }
    Ok(CreateParams {
        qcow2,
        parallels_cluster: (a.format == Format::Parallels).then_some(cluster),
        size_bytes,
        cluster_bits: cluster.trailing_zeros(),
        compression: match a.compression_type {
            CompressionArg::Zlib => Compression::Zlib,
            CompressionArg::Zstd => Compression::Zstd,
        },
        backing: backing.map(|(n, f, _)| (n, f)),
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
            backing: None,
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
                backing: Some(("base.raw".into(), "raw")),
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
                backing: None,
            },
        )
        .unwrap();
        let m = std::fs::metadata(&p).unwrap();
        assert_eq!(m.len(), 1 << 30);
        std::fs::remove_file(p).unwrap();
    }
}
