//! Opening an image: a remote disk through its driver (`remote`); a local one's file
//! (O_DIRECT for `--cache none`), its direct-I/O alignment, its locks, the format (given, or
//! probed by magic), and the format's own state, with every option passed once in
//! [`ImageOptions`].

use std::fs::Metadata;

use log::{info, warn};

use super::chain::open_chain;
use super::lock::{lock_file, ImageLock, Perms};
use super::parallels::{ParallelsImage, ParallelsOptions};
use super::prealloc::PreallocParams;
use super::qcow2::{self, CompressOptions, Qcow2Image, Qcow2Options};
use super::{
    open_raw, probe, remote, Disk, Format, Image, ImageOpenError, ImageOptions, Kind, Local,
    OpenError, PreallocChoice, Qcow2Disk, RawFacts,
};
use crate::io::align::{self, DioAlign, ProbeSource};
use crate::offload::Pool;

impl Image {
    /// Open the image as `opts` says; returns it with the file's direct-I/O alignment.
    pub fn open(opts: &ImageOptions) -> Result<(Image, DioAlign, RawFacts), ImageOpenError> {
        if let Some(r) = remote::open(opts, false) {
            return r;
        }
        let img = open_raw(
            &opts.path,
            opts.read_only,
            opts.direct,
            opts.logical_block_size,
        )?;
        let (dio, source) = align::probe(&img.file, opts.direct);
        if source != ProbeSource::NotDirect {
            info!(
                "O_DIRECT alignment: memory {} bytes, offset {} bytes (from {:?})",
                dio.mem, dio.offset, source
            );
        }
        let meta = img.file.metadata().map_err(|source| OpenError::Open {
            path: opts.path.clone(),
            source,
        })?;
        let facts = RawFacts {
            is_block_device: img.is_block_device,
            dev_ino: img.dev_ino,
            file_size_bytes: img.size_bytes,
            write_cache: None,
        };
        // Locked before anything is read or written: a read-write open of a format may
        // change the file (a crash's tail trimmed, autoclear bits cleared).
        let perms = match (opts.read_only, opts.force_share) {
            (false, _) => Perms::READ_WRITE,
            (true, false) => Perms::READ_ONLY,
            (true, true) => Perms::FORCE_SHARE,
        };
        let lock = lock_file(&img.file, &opts.path, perms, opts.locking)?;
        let format = opts
            .format
            .unwrap_or_else(|| probe(&img.file).unwrap_or(Format::Raw));
        let file = img.file;
        let (kind, size_bytes) = match format {
            Format::Raw => (Kind::Raw, img.size_bytes),
            Format::Luks => {
                let (l, size) = super::luks::open(&file, opts, img.size_bytes)?;
                (Kind::Luks(l), size)
            }
            Format::Parallels => {
                let p = open_parallels(&file, opts, dio)?;
                let size = p.size_bytes;
                (Kind::Parallels(p), size)
            }
            Format::Qcow2 => {
                let d = open_qcow2(&file, opts, dio, &meta)?;
                let size = d.q.size_bytes();
                (Kind::Qcow2(d), size)
            }
        };
        if opts.compress.is_some() && (opts.read_only || !matches!(kind, Kind::Qcow2(_))) {
            return Err(ImageOpenError::Option(
                "--compress-writes on: needs a qcow2 image opened read-write".into(),
            ));
        }
        let encrypted = match &kind {
            Kind::Luks(_) => true,
            Kind::Qcow2(d) => d.q.crypt().is_some(),
            _ => false,
        };
        if opts.key.is_some() && !encrypted {
            return Err(not_encrypted(opts, format));
        }
        let facts = RawFacts {
            file_size_bytes: img.size_bytes,
            ..facts
        };
        Ok((
            Image {
                disk: Disk::Local(Local { file, kind }),
                size_bytes: std::sync::atomic::AtomicU64::new(size_bytes),
                read_only: opts.read_only,
                block_device: facts.is_block_device,
                prealloc_raw: opts.prealloc == PreallocChoice::On,
                guard_header: opts.format.is_none() && format == Format::Raw,
                lock: std::sync::Mutex::new(lock),
                active: std::sync::atomic::AtomicBool::new(true),
            },
            dio,
            facts,
        ))
    }
}

impl Image {
    /// The image as a migration destination (`--incoming`) holds it before its frontend
    /// starts the queues: opened read-only without locks, only the header read (for the size
    /// the guest is shown), inactive (`handover`): it serves nothing until taken over.
    pub fn incoming(opts: &ImageOptions) -> Result<(Image, DioAlign, RawFacts), ImageOpenError> {
        if let Some(r) = remote::open(opts, true) {
            return r;
        }
        let img = open_raw(&opts.path, true, opts.direct, opts.logical_block_size)?;
        let (dio, _) = align::probe(&img.file, opts.direct);
        let facts = RawFacts {
            is_block_device: img.is_block_device,
            dev_ino: img.dev_ino,
            file_size_bytes: img.size_bytes,
            write_cache: None,
        };
        let format = opts
            .format
            .unwrap_or_else(|| probe(&img.file).unwrap_or(Format::Raw));
        let header = |len| {
            crate::io::aligned::read_aligned(&img.file, 0, len).map_err(|source| OpenError::Open {
                path: opts.path.clone(),
                source,
            })
        };
        let bad = |what: &str| ImageOpenError::Option(format!("{}: {what}", opts.path.display()));
        if opts.key.is_some() && matches!(format, Format::Raw | Format::Parallels) {
            return Err(not_encrypted(opts, format));
        }
        let size_bytes = match format {
            Format::Raw => img.size_bytes,
            Format::Qcow2 => {
                qcow2::header::Header::parse(&header(4096)?)
                    .map_err(|e| bad(&format!("not a qcow2 header ({e})")))?
                    .size_bytes
            }
            Format::Parallels => ParallelsImage::header_size(&header(4096)?)
                .ok_or_else(|| bad("not a parallels header"))?,
            // The size is the data segment's: the header says where it starts (no key needed).
            Format::Luks => {
                let mut read =
                    |off: u64, len: usize| crate::io::aligned::read_aligned(&img.file, off, len);
                let h = crate::crypt::parse(img.size_bytes, &mut read)
                    .map_err(|e| bad(&format!("not a usable LUKS header ({e})")))?;
                let end = h
                    .data_size
                    .map_or(img.size_bytes, |n| h.data_offset.saturating_add(n));
                let s = u64::from(h.sector_size);
                end.saturating_sub(h.data_offset) / s * s
            }
        };
        info!(
            "incoming: {} ({format:?}, {size_bytes} bytes) not locked and not read beyond its \
             header until the frontend starts the queues",
            opts.path.display()
        );
        Ok((
            Image {
                disk: Disk::Local(Local {
                    file: img.file,
                    kind: Kind::Raw,
                }),
                size_bytes: std::sync::atomic::AtomicU64::new(size_bytes),
                read_only: true,
                block_device: facts.is_block_device,
                prealloc_raw: false,
                guard_header: false,
                lock: std::sync::Mutex::new(ImageLock::unlocked()),
                active: std::sync::atomic::AtomicBool::new(false),
            },
            dio,
            facts,
        ))
    }
}

fn open_parallels(
    file: &std::fs::File,
    opts: &ImageOptions,
    dio: DioAlign,
) -> Result<ParallelsImage, ImageOpenError> {
    let writable = !opts.read_only;
    // QEMU's driver always preallocates: `auto` is on.
    let prealloc = (writable && opts.prealloc != PreallocChoice::Off)
        .then_some((opts.prealloc_mode, opts.prealloc_size));
    let popts = ParallelsOptions {
        writable,
        // Metadata is written in blocks of the file's direct-I/O alignment.
        chunk: if opts.direct { dio.offset as u64 } else { 512 },
        prealloc,
    };
    let p = ParallelsImage::open(file, popts).map_err(|source| ImageOpenError::Parallels {
        path: opts.path.clone(),
        source,
    })?;
    if p.was_in_use && p.writable() {
        warn!(
            "parallels: {} was not closed cleanly (in-use set): checked it: every BAT entry \
             inside the file and used once, {} bytes of leaked tail cut off",
            opts.path.display(),
            p.trimmed_at_open
        );
    }
    info!(
        "parallels: {} bytes, {} KiB clusters, {} clusters allocated, data at {}{}",
        p.size_bytes,
        p.cluster_size >> 10,
        p.allocated_clusters(),
        p.data_off,
        if p.ext_cluster.is_some() {
            ", format extension cluster kept"
        } else {
            ""
        }
    );
    if writable {
        match prealloc {
            Some((mode, size)) => info!(
                "preallocation: {:?}, {} MiB ahead of the data (auto is on for parallels)",
                mode,
                size.max(p.cluster_size) >> 20
            ),
            None => info!("preallocation: off (the file grows cluster by cluster)"),
        }
    }
    Ok(p)
}

fn open_qcow2(
    file: &std::fs::File,
    opts: &ImageOptions,
    dio: DioAlign,
    meta: &Metadata,
) -> Result<Qcow2Disk, ImageOpenError> {
    let writable = !opts.read_only;
    let file_align = dio.offset as u64;
    let mut qopts = Qcow2Options {
        writable,
        l2_cache_bytes: opts.l2_cache_bytes,
        punch_freed: opts.discard_unmap,
        ..Qcow2Options::default()
    };
    let mut prealloc_why = None;
    if writable {
        if !opts.prealloc_align.is_multiple_of(file_align) {
            return Err(ImageOpenError::Option(format!(
                "--prealloc-align {}: must be a multiple of the file's alignment ({file_align} \
                 bytes)",
                opts.prealloc_align
            )));
        }
        let (on, why) = match opts.prealloc {
            PreallocChoice::On => (true, "--prealloc on".to_owned()),
            PreallocChoice::Off => (false, "--prealloc off".to_owned()),
            PreallocChoice::Auto => match crate::io::sys::disk_info(meta) {
                Some(d) if !d.rotational => (true, format!("auto: {} is not rotational", d.name)),
                Some(d) => match d.virtual_disk {
                    // Measured on a virtio disk over an SSD-backed host (BENCHMARKS.md):
                    // preallocation wins there; a virtual disk cannot tell what it sits on.
                    Some(driver) => (
                        true,
                        format!(
                            "auto: {} is a virtual disk ({driver}), whose rotational flag is \
                             only a default",
                            d.name
                        ),
                    ),
                    None => (false, format!("auto: {} is rotational", d.name)),
                },
                None => (
                    false,
                    "auto: the file system's block device is unknown".to_owned(),
                ),
            },
        };
        if on {
            qopts.prealloc = Some(PreallocParams {
                size: opts.prealloc_size,
                align: opts.prealloc_align,
                file_align,
            });
            match file.try_clone() {
                Ok(f) => qopts.prealloc_file = Some(f),
                Err(e) => warn!("preallocation on the queue threads (no second handle: {e})"),
            }
        }
        prealloc_why = Some((on, why));
    }
    // The cache's bound is checked against the cluster size in the header (a header that
    // does not parse fails the open below with the reason).
    if let (Some(c), true) = (opts.compress, writable) {
        let cluster = crate::io::aligned::read_aligned(file, 0, 4096)
            .ok()
            .and_then(|b| qcow2::header::Header::parse(&b).ok())
            .map_or(1, |h| 1u64 << h.cluster_bits);
        let clusters = match c.cache_bytes {
            None => qcow2::DEFAULT_COMPRESSED_CACHE_CLUSTERS,
            Some(n) if n >= cluster => (n / cluster) as usize,
            Some(n) => {
                return Err(ImageOpenError::Option(format!(
                    "--compressed-cache-size {n}: smaller than one cluster ({cluster} bytes)"
                )))
            }
        };
        qopts.compress = Some(CompressOptions {
            cache: c.cache,
            cache_clusters: clusters,
        });
    }
    let compress = qopts.compress;
    qopts.encrypted = true;
    let q = Qcow2Image::open(file, qopts).map_err(|source| ImageOpenError::Qcow2 {
        path: opts.path.clone(),
        source,
    })?;
    if let Some(region) = q.crypt_region() {
        if compress.is_some() {
            return Err(ImageOpenError::Option(
                "--compress-writes on: an encrypted qcow2 image is never compressed (QEMU \
                 refuses it too)"
                    .into(),
            ));
        }
        if q.backing_file.is_some() {
            return Err(ImageOpenError::Option(format!(
                "{}: an encrypted qcow2 image with a backing file is not supported yet",
                opts.path.display()
            )));
        }
        let vol = super::luks::unlock_qcow2(file, opts, region)?;
        q.set_crypt(std::sync::Arc::new(vol));
    }
    info!(
        "qcow2 v{}: {} bytes, {} KiB clusters, {:?} compression, L2 cache {} KiB (maps {} MiB)",
        q.version,
        q.size_bytes(),
        q.cluster_size() >> 10,
        q.compression,
        q.l2_cache_bytes().0 >> 10,
        q.l2_cache_bytes().1 >> 20
    );
    let backing = open_chain(
        &opts.path,
        q.backing_file.as_deref(),
        opts.follow_backing,
        opts.direct,
        opts.locking,
    )?;
    for l in &backing {
        info!(
            "backing file {} ({}, read-only)",
            l.path.display(),
            l.format_name()
        );
    }
    let mut d = Qcow2Disk {
        q,
        backing,
        cow_pool: None,
        compress_pool: None,
    };
    if writable {
        if opts.cow_threads > 0 {
            match Pool::new(opts.cow_threads, "vublk-cow") {
                Ok(p) => d.cow_pool = Some(p),
                Err(e) => warn!("copy-on-write on the queue threads (no thread pool: {e})"),
            }
        }
        if let (Some(c), Some(qc)) = (opts.compress, compress) {
            if c.threads > 0 {
                match Pool::new(c.threads, "vublk-compress") {
                    Ok(p) => d.compress_pool = Some(p),
                    Err(e) => warn!("compressing on the queue threads (no thread pool: {e})"),
                }
            }
            info!(
                "compressed writes: on ({:?}, cache {}, {} compression threads): clusters \
                 written whole are stored compressed",
                d.q.compression,
                if c.cache {
                    format!("on, {} clusters", qc.cache_clusters)
                } else {
                    "off".into()
                },
                c.threads
            );
        }
        match prealloc_why {
            Some((true, why)) => info!(
                "preallocation: on ({why}): {} MiB ahead, lengths rounded to {} KiB",
                opts.prealloc_size >> 20,
                opts.prealloc_align >> 10
            ),
            Some((false, why)) => info!("preallocation: off ({why})"),
            None => {}
        }
    }
    Ok(d)
}

/// A key was given for an image that is not encrypted (a damaged or replaced header, or the
/// wrong file): serving it would write the guest's data in the clear.
fn not_encrypted(opts: &ImageOptions, format: Format) -> ImageOpenError {
    ImageOpenError::Option(format!(
        "{}: --key-secret was given, but the image is not encrypted ({} without encryption; \
         no LUKS header found): refusing to serve it in the clear",
        opts.path.display(),
        match format {
            Format::Raw => "raw",
            Format::Qcow2 => "qcow2",
            Format::Parallels => "parallels",
            Format::Luks => "LUKS",
        }
    ))
}
