//! The qcow2 header (docs/interop/qcow2.rst, "Header"): every field at its named offset,
//! parsed into [`Header`] with the checks that need nothing but the header itself, and
//! serialised back for `vublk create` and for the header updates the engine makes.

use super::Qcow2Error;

/// "QFI\xfb".
pub const MAGIC: [u8; 4] = *b"QFI\xfb";

/// Byte offsets of the header fields (all big-endian).
pub mod off {
    pub const MAGIC: usize = 0;
    pub const VERSION: usize = 4;
    pub const BACKING_FILE_OFFSET: usize = 8;
    pub const BACKING_FILE_SIZE: usize = 16;
    pub const CLUSTER_BITS: usize = 20;
    pub const SIZE: usize = 24;
    pub const CRYPT_METHOD: usize = 32;
    pub const L1_SIZE: usize = 36;
    pub const L1_TABLE_OFFSET: usize = 40;
    pub const REFCOUNT_TABLE_OFFSET: usize = 48;
    pub const REFCOUNT_TABLE_CLUSTERS: usize = 56;
    pub const NB_SNAPSHOTS: usize = 60;
    pub const SNAPSHOTS_OFFSET: usize = 64;
    /// Version 3 only, from here on.
    pub const INCOMPATIBLE_FEATURES: usize = 72;
    pub const COMPATIBLE_FEATURES: usize = 80;
    pub const AUTOCLEAR_FEATURES: usize = 88;
    pub const REFCOUNT_ORDER: usize = 96;
    pub const HEADER_LENGTH: usize = 100;
    /// Present when the header length is at least 105.
    pub const COMPRESSION_TYPE: usize = 104;
}

/// Length of a version 2 header.
pub const V2_LEN: usize = 72;
/// Length of the fixed part of a version 3 header.
pub const V3_LEN: usize = 104;
/// A v3 header with the compression type byte, padded to a multiple of 8 (what
/// `vublk create` writes).
pub const V3_LEN_WITH_COMPRESSION: u32 = 112;

/// Incompatible feature bits.
pub const INCOMPAT_DIRTY: u64 = 1 << 0;
pub const INCOMPAT_CORRUPT: u64 = 1 << 1;
pub const INCOMPAT_DATA_FILE: u64 = 1 << 2;
pub const INCOMPAT_COMPRESSION: u64 = 1 << 3;
pub const INCOMPAT_EXTL2: u64 = 1 << 4;
const INCOMPAT_KNOWN: u64 =
    INCOMPAT_DIRTY | INCOMPAT_CORRUPT | INCOMPAT_DATA_FILE | INCOMPAT_COMPRESSION | INCOMPAT_EXTL2;

/// Autoclear feature bit: the bitmaps extension (persistent dirty bitmaps) is consistent.
pub const AUTOCLEAR_BITMAPS: u64 = 1 << 0;

/// Header extension type: backing file format name.
pub const EXT_BACKING_FORMAT: u32 = 0xe279_2aca;
/// Header extension type: persistent dirty bitmaps (their clusters are referenced from the
/// bitmap directory, not from L2 tables).
pub const EXT_BITMAPS: u32 = 0x2385_2875;
/// The full disk encryption header pointer: where the LUKS header is (offset, length).
pub const EXT_CRYPTO: u32 = 0x0537_be77;
/// `crypt_method` of a qcow2 image encrypted with LUKS (`encrypt.format=luks`).
pub const CRYPT_LUKS: u32 = 2;
/// The spec bounds a backing file name to 1023 bytes.
pub const MAX_BACKING_NAME: usize = 1023;

/// Snapshot table entry fields (docs/interop/qcow2.rst, "Snapshots").
pub mod snap {
    pub const L1_TABLE_OFFSET: usize = 0;
    pub const L1_SIZE: usize = 8;
    pub const ID_STR_SIZE: usize = 12;
    pub const NAME_SIZE: usize = 14;
    pub const EXTRA_DATA_SIZE: usize = 36;
    /// Length of the fixed part; then extra data, the id and the name, padded to 8.
    pub const FIXED_LEN: usize = 40;
}

/// The kind of compression for compressed clusters (`vublk create --compression-type`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Compression {
    Zlib,
    Zstd,
}

impl Compression {
    fn from_type(t: u8) -> Result<Self, Qcow2Error> {
        match t {
            0 => Ok(Compression::Zlib),
            1 => Ok(Compression::Zstd),
            t => Err(Qcow2Error::CompressionType(t)),
        }
    }

    fn type_byte(self) -> u8 {
        match self {
            Compression::Zlib => 0,
            Compression::Zstd => 1,
        }
    }
}

/// The header fields vublk uses.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Header {
    pub version: u32,
    pub backing_file_offset: u64,
    pub backing_file_size: u32,
    pub cluster_bits: u32,
    pub size_bytes: u64,
    pub l1_size: u32,
    pub l1_table_offset: u64,
    pub refcount_table_offset: u64,
    pub refcount_table_clusters: u32,
    pub nb_snapshots: u32,
    pub snapshots_offset: u64,
    pub incompatible_features: u64,
    /// Bit 0: the bitmaps extension is consistent; bit 1: the external data file is raw.
    /// vublk maintains neither, so a read-write open clears them all (the spec's rule for
    /// autoclear bits a writer does not maintain).
    pub autoclear_features: u64,
    /// log2 of the refcount width in bits (4 for version 2).
    pub refcount_order: u32,
    pub header_length: u32,
    pub compression: Compression,
    /// 0: not encrypted; [`CRYPT_LUKS`] (the legacy AES method is refused).
    pub crypt_method: u32,
}

/// The header's first cluster `old` (parsed as `h`) with the extension of type `replace`
/// dropped and `add` appended (other extensions kept in their order), and the backing file
/// name after the list: as it was (`backing` None), or the new one (`Some(None)`: no
/// backing file). Err: it does not fit in the first cluster, or the old list is malformed.
pub fn rebuild(
    old: &[u8],
    h: &Header,
    replace: u32,
    add: Option<(u32, &[u8])>,
    backing: Option<Option<&[u8]>>,
) -> Result<Vec<u8>, String> {
    let fixed = h.header_length as usize;
    if !(V3_LEN..=old.len().saturating_sub(8)).contains(&fixed) {
        return Err(format!("a header length of {fixed} bytes"));
    }
    let mut exts: Vec<(u32, &[u8])> = Vec::new();
    let mut pos = fixed;
    loop {
        let hd = old
            .get(pos..pos + 8)
            .ok_or("the header extensions run past the first cluster")?;
        let (t, len) = (be32(hd, 0), be32(hd, 4) as usize);
        if t == 0 {
            break;
        }
        let data = old
            .get(pos + 8..pos + 8 + len)
            .ok_or("a header extension runs past the first cluster")?;
        if t != replace {
            exts.push((t, data));
        }
        pos += 8 + len.next_multiple_of(8);
    }
    let old_name = h
        .backing_file(old)
        .map_err(|e| e.to_string())?
        .map(String::into_bytes);
    let name: Option<&[u8]> = match backing {
        None => old_name.as_deref(),
        Some(n) => n,
    };
    let mut out = old[..fixed].to_vec();
    exts.extend(add);
    for (t, data) in exts {
        let mut hd = [0u8; 8];
        put32(&mut hd, 0, t);
        put32(&mut hd, 4, data.len() as u32);
        out.extend_from_slice(&hd);
        out.extend_from_slice(data);
        out.resize(out.len().next_multiple_of(8), 0);
    }
    out.extend_from_slice(&[0u8; 8]);
    match name {
        Some(name) => {
            let at = out.len();
            put64(&mut out, off::BACKING_FILE_OFFSET, at as u64);
            put32(&mut out, off::BACKING_FILE_SIZE, name.len() as u32);
            out.extend_from_slice(name);
        }
        None => {
            put64(&mut out, off::BACKING_FILE_OFFSET, 0);
            put32(&mut out, off::BACKING_FILE_SIZE, 0);
        }
    }
    if out.len() > old.len() {
        return Err(format!(
            "the header needs {} bytes; its cluster has {}",
            out.len(),
            old.len()
        ));
    }
    // What followed the old list (a longer backing name, stale bytes) reads as zeroes.
    let old_used = pos + 8 + h.backing_file_size as usize;
    out.resize(old_used.max(out.len()).min(old.len()), 0);
    Ok(out)
}

pub(super) fn be32(b: &[u8], off: usize) -> u32 {
    u32::from_be_bytes([b[off], b[off + 1], b[off + 2], b[off + 3]])
}

pub(super) fn be64(b: &[u8], off: usize) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[off..off + 8]);
    u64::from_be_bytes(a)
}

pub fn put32(b: &mut [u8], off: usize, v: u32) {
    b[off..off + 4].copy_from_slice(&v.to_be_bytes());
}

pub fn put64(b: &mut [u8], off: usize, v: u64) {
    b[off..off + 8].copy_from_slice(&v.to_be_bytes());
}

impl Header {
    /// A version 3 header for a new image (16-bit refcounts, nothing else set).
    /// Extended L2 entries: 32 subclusters per cluster, each allocated or zero on its own.
    pub fn extended_l2(&self) -> bool {
        self.incompatible_features & INCOMPAT_EXTL2 != 0
    }

    pub fn new_v3(cluster_bits: u32, size_bytes: u64, compression: Compression) -> Self {
        Header {
            version: 3,
            backing_file_offset: 0,
            backing_file_size: 0,
            cluster_bits,
            size_bytes,
            l1_size: 0,
            l1_table_offset: 0,
            refcount_table_offset: 0,
            refcount_table_clusters: 0,
            nb_snapshots: 0,
            snapshots_offset: 0,
            incompatible_features: match compression {
                Compression::Zlib => 0,
                Compression::Zstd => INCOMPAT_COMPRESSION,
            },
            autoclear_features: 0,
            refcount_order: 4,
            header_length: V3_LEN_WITH_COMPRESSION,
            compression,
            crypt_method: 0,
        }
    }

    /// Parse and check the header at the start of `b` (the image's first bytes, at least
    /// [`V2_LEN`]): magic, version, cluster size, encryption, the refcount order and, for
    /// version 3, unknown incompatible features, external data files, extended L2 entries'
    /// cluster size and the compression type. Whether a dirty or corrupt image may be opened is the
    /// caller's decision.
    pub fn parse(b: &[u8]) -> Result<Self, Qcow2Error> {
        if b.len() < V2_LEN || b[off::MAGIC..off::MAGIC + 4] != MAGIC {
            return Err(Qcow2Error::BadMagic);
        }
        let version = be32(b, off::VERSION);
        if version != 2 && version != 3 {
            return Err(Qcow2Error::Version(version));
        }
        let cluster_bits = be32(b, off::CLUSTER_BITS);
        if !(9..=21).contains(&cluster_bits) {
            return Err(Qcow2Error::ClusterBits(cluster_bits));
        }
        let crypt_method = be32(b, off::CRYPT_METHOD);
        if crypt_method != 0 && crypt_method != CRYPT_LUKS {
            return Err(Qcow2Error::Encrypted);
        }
        let mut h = Header {
            version,
            backing_file_offset: be64(b, off::BACKING_FILE_OFFSET),
            backing_file_size: be32(b, off::BACKING_FILE_SIZE),
            cluster_bits,
            size_bytes: be64(b, off::SIZE),
            l1_size: be32(b, off::L1_SIZE),
            l1_table_offset: be64(b, off::L1_TABLE_OFFSET),
            refcount_table_offset: be64(b, off::REFCOUNT_TABLE_OFFSET),
            refcount_table_clusters: be32(b, off::REFCOUNT_TABLE_CLUSTERS),
            nb_snapshots: be32(b, off::NB_SNAPSHOTS),
            snapshots_offset: be64(b, off::SNAPSHOTS_OFFSET),
            incompatible_features: 0,
            autoclear_features: 0,
            refcount_order: 4,
            header_length: V2_LEN as u32,
            compression: Compression::Zlib,
            crypt_method,
        };
        if version == 3 {
            if b.len() < V3_LEN {
                return Err(Qcow2Error::BadMagic);
            }
            let incompat = be64(b, off::INCOMPATIBLE_FEATURES);
            if incompat & !INCOMPAT_KNOWN != 0 {
                return Err(Qcow2Error::UnknownFeatures(incompat & !INCOMPAT_KNOWN));
            }
            if incompat & INCOMPAT_DATA_FILE != 0 {
                return Err(Qcow2Error::ExternalDataFile);
            }
            // Subclusters are 1/32 of a cluster and at least 512 bytes (QEMU asks for
            // 16 KiB clusters at least).
            if incompat & INCOMPAT_EXTL2 != 0 && h.cluster_bits < 14 {
                return Err(Qcow2Error::ExtendedL2(h.cluster_bits));
            }
            h.incompatible_features = incompat;
            h.autoclear_features = be64(b, off::AUTOCLEAR_FEATURES);
            h.refcount_order = be32(b, off::REFCOUNT_ORDER);
            h.header_length = be32(b, off::HEADER_LENGTH);
            if incompat & INCOMPAT_COMPRESSION != 0 {
                if (h.header_length as usize) <= off::COMPRESSION_TYPE
                    || b.len() <= off::COMPRESSION_TYPE
                {
                    return Err(Qcow2Error::BadMagic);
                }
                h.compression = Compression::from_type(b[off::COMPRESSION_TYPE])?;
            }
        }
        if h.refcount_order > 6 {
            return Err(Qcow2Error::RefcountOrder(h.refcount_order));
        }
        Ok(h)
    }

    pub fn is_dirty(&self) -> bool {
        self.incompatible_features & INCOMPAT_DIRTY != 0
    }

    pub fn is_corrupt(&self) -> bool {
        self.incompatible_features & INCOMPAT_CORRUPT != 0
    }

    /// The backing file name stored in `first_cluster` (the header's cluster), if any.
    pub fn backing_file(&self, first_cluster: &[u8]) -> Result<Option<String>, Qcow2Error> {
        if self.backing_file_offset == 0 {
            return Ok(None);
        }
        let len = self.backing_file_size as usize;
        let name = usize::try_from(self.backing_file_offset)
            .ok()
            .filter(|_| len > 0 && len <= MAX_BACKING_NAME)
            .and_then(|o| first_cluster.get(o..o.checked_add(len)?))
            .ok_or(Qcow2Error::BackingName)?;
        String::from_utf8(name.to_vec())
            .map(Some)
            .map_err(|_| Qcow2Error::BackingName)
    }

    /// Does the header (in `first`, the image's first bytes) carry an extension of type `ty`?
    /// Walks the extensions after the header (bounded by `first`; a malformed list ends the
    /// walk: then the answer is yes, the cautious one for callers).
    pub fn has_extension(&self, first: &[u8], ty: u32) -> bool {
        let mut pos = if self.version >= 3 {
            self.header_length as usize
        } else {
            V2_LEN
        };
        loop {
            let Some(h) = first.get(pos..pos + 8) else {
                return true;
            };
            let (t, len) = (be32(h, 0), be32(h, 4) as usize);
            if t == 0 {
                return false;
            }
            if t == ty {
                return true;
            }
            pos = match pos.checked_add(8 + len.next_multiple_of(8)) {
                Some(p) => p,
                None => return true,
            };
        }
    }

    /// The data of the header extension of type `ty` in `first` (the image's first bytes),
    /// if there is one and it lies inside `first`. A malformed list ends the walk (None).
    pub fn extension_data<'a>(&self, first: &'a [u8], ty: u32) -> Option<&'a [u8]> {
        let mut pos = if self.version >= 3 {
            self.header_length as usize
        } else {
            V2_LEN
        };
        loop {
            let h = first.get(pos..pos.checked_add(8)?)?;
            let (t, len) = (be32(h, 0), be32(h, 4) as usize);
            if t == 0 {
                return None;
            }
            if t == ty {
                return first.get(pos + 8..(pos + 8).checked_add(len)?);
            }
            pos = pos.checked_add(8 + len.next_multiple_of(8))?;
        }
    }

    /// Write the header's fields into `b` (at least [`V3_LEN`] + 1 bytes for version 3);
    /// bytes between the fields are left as they are.
    pub fn write_to(&self, b: &mut [u8]) {
        b[off::MAGIC..off::MAGIC + 4].copy_from_slice(&MAGIC);
        put32(b, off::VERSION, self.version);
        put64(b, off::BACKING_FILE_OFFSET, self.backing_file_offset);
        put32(b, off::BACKING_FILE_SIZE, self.backing_file_size);
        put32(b, off::CLUSTER_BITS, self.cluster_bits);
        put64(b, off::SIZE, self.size_bytes);
        put32(b, off::CRYPT_METHOD, self.crypt_method);
        put32(b, off::L1_SIZE, self.l1_size);
        put64(b, off::L1_TABLE_OFFSET, self.l1_table_offset);
        put64(b, off::REFCOUNT_TABLE_OFFSET, self.refcount_table_offset);
        put32(
            b,
            off::REFCOUNT_TABLE_CLUSTERS,
            self.refcount_table_clusters,
        );
        put32(b, off::NB_SNAPSHOTS, self.nb_snapshots);
        put64(b, off::SNAPSHOTS_OFFSET, self.snapshots_offset);
        if self.version >= 3 {
            put64(b, off::INCOMPATIBLE_FEATURES, self.incompatible_features);
            put64(b, off::COMPATIBLE_FEATURES, 0);
            put64(b, off::AUTOCLEAR_FEATURES, self.autoclear_features);
            put32(b, off::REFCOUNT_ORDER, self.refcount_order);
            put32(b, off::HEADER_LENGTH, self.header_length);
            if self.header_length as usize > off::COMPRESSION_TYPE {
                b[off::COMPRESSION_TYPE] = self.compression.type_byte();
            }
        }
    }
}

/// Point the header in `b` at a new refcount table (offset and clusters share one sector,
/// so the change reaches the file in one atomic write).
pub fn set_refcount_table(b: &mut [u8], offset: u64, clusters: u32) {
    put64(b, off::REFCOUNT_TABLE_OFFSET, offset);
    put32(b, off::REFCOUNT_TABLE_CLUSTERS, clusters);
}

/// One snapshot table entry's fixed part.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SnapshotEntry {
    pub l1_table_offset: u64,
    pub l1_bytes: u64,
    /// Length of the whole entry (padded to 8).
    pub entry_len: u64,
}

impl SnapshotEntry {
    /// Parse the fixed part of an entry (`b` holds at least [`snap::FIXED_LEN`] bytes).
    pub fn parse(b: &[u8]) -> Self {
        let extra = u64::from(be32(b, snap::EXTRA_DATA_SIZE));
        let names = u64::from(u16::from_be_bytes([
            b[snap::ID_STR_SIZE],
            b[snap::ID_STR_SIZE + 1],
        ])) + u64::from(u16::from_be_bytes([
            b[snap::NAME_SIZE],
            b[snap::NAME_SIZE + 1],
        ]));
        SnapshotEntry {
            l1_table_offset: be64(b, snap::L1_TABLE_OFFSET),
            l1_bytes: u64::from(be32(b, snap::L1_SIZE)) * 8,
            entry_len: (snap::FIXED_LEN as u64 + extra + names).next_multiple_of(8),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn extensions_are_found() {
        let h = Header::new_v3(16, 1 << 30, Compression::Zlib);
        let mut b = vec![0u8; 4096];
        h.write_to(&mut b);
        let at = h.header_length as usize;
        assert!(!h.has_extension(&b, EXT_BITMAPS));
        put32(&mut b, at, EXT_BACKING_FORMAT);
        put32(&mut b, at + 4, 3);
        b[at + 8..at + 11].copy_from_slice(b"raw");
        put32(&mut b, at + 16, EXT_BITMAPS);
        assert!(h.has_extension(&b, EXT_BITMAPS));
        assert!(h.has_extension(&b, EXT_BACKING_FORMAT));
        // A length running off the buffer: cautious.
        put32(&mut b, at + 4, u32::MAX);
        assert!(h.has_extension(&b, 0x1234));
    }

    #[test]
    fn a_new_header_parses_back_to_itself() {
        let mut h = Header::new_v3(16, 1 << 30, Compression::Zstd);
        h.l1_size = 2;
        h.l1_table_offset = 3 << 16;
        h.refcount_table_offset = 1 << 16;
        h.refcount_table_clusters = 1;
        let mut b = vec![0u8; 4096];
        h.write_to(&mut b);
        assert_eq!(Header::parse(&b).unwrap(), h);
        assert_eq!(b[off::COMPRESSION_TYPE], 1);
        assert_eq!(be64(&b, off::INCOMPATIBLE_FEATURES), INCOMPAT_COMPRESSION);
    }

    #[test]
    fn unknown_incompatible_features_are_refused() {
        let mut b = vec![0u8; 512];
        Header::new_v3(16, 1 << 20, Compression::Zlib).write_to(&mut b);
        put64(&mut b, off::INCOMPATIBLE_FEATURES, 1 << 40);
        assert!(matches!(
            Header::parse(&b),
            Err(Qcow2Error::UnknownFeatures(_))
        ));
    }

    #[test]
    fn a_short_or_foreign_header_is_bad_magic() {
        assert!(matches!(
            Header::parse(&[0u8; 10]),
            Err(Qcow2Error::BadMagic)
        ));
        assert!(matches!(
            Header::parse(&[0u8; 512]),
            Err(Qcow2Error::BadMagic)
        ));
    }
}
