//! Parse one descriptor chain into a [`Request`]. Every check the spec asks of the device
//! happens here, once; nothing a guest puts in a chain can panic or reach I/O unchecked.

use vm_memory::{Address, Bytes, GuestAddress, GuestMemoryBackend};

use super::{req_type, status, HEADER_LEN, RANGE_FLAG_UNMAP, RANGE_LEN, SECTOR_SHIFT, SECTOR_SIZE};

/// One descriptor as the parser needs it (decoupled from virtio-queue for tests).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Desc {
    pub addr: u64,
    pub len: u32,
    /// Device-writable (VIRTQ_DESC_F_WRITE).
    pub write_only: bool,
}

/// A run of request data in guest memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Segment {
    pub addr: GuestAddress,
    pub len: u32,
}

/// One discard / write-zeroes range, validated against the device.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Range {
    pub offset_bytes: u64,
    pub len_bytes: u64,
    /// The guest allows deallocation (WRITE_ZEROES with the UNMAP flag).
    pub unmap: bool,
}

/// Decoded request type.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RequestType {
    In,
    Out,
    Flush,
    GetId,
    Discard,
    WriteZeroes,
}

/// What the device tells the parser about itself.
#[derive(Clone, Copy, Debug)]
pub struct DeviceLimits {
    pub capacity_sectors: u64,
    pub logical_block_size: u32,
    pub read_only: bool,
    /// Data segments per request (config seg_max).
    pub seg_max: u32,
    pub max_discard_sectors: u32,
    pub max_discard_seg: u32,
    pub max_write_zeroes_sectors: u32,
    pub max_write_zeroes_seg: u32,
}

/// Why a request was refused. Guest faults and the status they map to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum RequestError {
    #[error("chain has no device-writable status byte")]
    NoStatus,
    #[error("chain has fewer than {HEADER_LEN} device-readable header bytes")]
    ShortHeader,
    #[error("device-readable descriptor after a device-writable one")]
    ReadableAfterWritable,
    #[error("chain has more than {0} descriptors")]
    TooManyDescriptors(u32),
    #[error("descriptor at {0:#x} is not in guest memory")]
    BadAddress(u64),
    #[error("unsupported request type {0}")]
    UnsupportedType(u32),
    #[error("data direction does not match the request type")]
    WrongDirection,
    #[error("sector {sector} + {len_bytes} bytes is outside the device")]
    OutOfRange { sector: u64, len_bytes: u64 },
    #[error("sector {sector} or length {len_bytes} not aligned to the logical block size")]
    Misaligned { sector: u64, len_bytes: u64 },
    #[error("write to a read-only device")]
    ReadOnly,
    #[error("range list of {0} bytes is not a whole number of ranges")]
    BadRangeList(u64),
    #[error("{0} ranges exceed the advertised maximum")]
    TooManyRanges(u64),
    #[error("range of {0} sectors exceeds the advertised maximum")]
    RangeTooLong(u32),
    #[error("range flags {0:#x} not supported")]
    UnsupportedRangeFlags(u32),
}

impl RequestError {
    /// Was the status byte found before parsing failed? Only then may the device write it
    /// (2.7.4: the device writes only device-writable buffers of the chain it was given; a
    /// chain cut short has no known last byte, and nothing may be written for it).
    pub fn status_known(&self) -> bool {
        !matches!(
            self,
            RequestError::NoStatus
                | RequestError::TooManyDescriptors(_)
                | RequestError::BadAddress(_)
        )
    }

    /// The one place that maps a refused request to its status byte.
    pub fn status(&self) -> u8 {
        match self {
            // 5.2.6.1: unknown types, and discard with the unmap flag or unknown flags,
            // are "unsupported".
            RequestError::UnsupportedType(_) | RequestError::UnsupportedRangeFlags(_) => {
                status::UNSUPP
            }
            _ => status::IOERR,
        }
    }
}

/// A parsed request. Reused across requests: `parse_request` clears and refills it, so the
/// vectors keep their capacity and the hot path does not allocate.
#[derive(Debug)]
pub struct Request {
    pub kind: RequestType,
    pub sector: u64,
    /// Data buffer(s): device-readable for OUT, device-writable for IN / GET_ID, the raw range
    /// list for DISCARD / WRITE_ZEROES.
    pub data: Vec<Segment>,
    pub data_len: u64,
    /// Where the status byte goes.
    pub status_addr: GuestAddress,
    /// Decoded ranges for DISCARD / WRITE_ZEROES.
    pub ranges: Vec<Range>,
}

impl Default for Request {
    fn default() -> Self {
        Request {
            kind: RequestType::Flush,
            sector: 0,
            data: Vec::new(),
            data_len: 0,
            status_addr: GuestAddress(0),
            ranges: Vec::new(),
        }
    }
}

impl Request {
    /// Byte offset of the request in the image.
    pub fn offset_bytes(&self) -> u64 {
        self.sector << SECTOR_SHIFT
    }
}

/// Copy `buf.len()` bytes starting `skip` bytes into `segs` out of guest memory.
fn read_from_segments<M: GuestMemoryBackend>(
    mem: &M,
    segs: &[Segment],
    mut skip: u64,
    buf: &mut [u8],
) -> Result<(), RequestError> {
    let mut done = 0usize;
    for s in segs {
        if done == buf.len() {
            break;
        }
        let len = u64::from(s.len);
        if skip >= len {
            skip -= len;
            continue;
        }
        let avail = (len - skip) as usize;
        let n = avail.min(buf.len() - done);
        let addr = s
            .addr
            .checked_add(skip)
            .ok_or(RequestError::BadAddress(s.addr.0))?;
        mem.read_slice(&mut buf[done..done + n], addr)
            .map_err(|_| RequestError::BadAddress(addr.0))?;
        done += n;
        skip = 0;
    }
    if done == buf.len() {
        Ok(())
    } else {
        Err(RequestError::ShortHeader)
    }
}

/// Parse a chain. Where [`RequestError::status_known`] says so, `req.status_addr` is valid
/// and the caller writes `err.status()` there; otherwise the status cannot be reported.
///
/// Layout rules (2.7.4, 5.2.6): all device-readable descriptors come first; the header is the
/// first 16 readable bytes, the status is the last writable byte; we make no assumption about
/// how the bytes are split among descriptors (2.6.4.1: "The device MUST NOT make assumptions
/// about the particular arrangement of descriptors").
// Out of line: inlined into the worker's loop it cost about 2% more CPU per 4 KiB request
// (BENCHMARKS.md, issue 31, "The data path").
#[inline(never)]
pub fn parse_request<M: GuestMemoryBackend>(
    mem: &M,
    descs: impl Iterator<Item = Desc>,
    limits: &DeviceLimits,
    req: &mut Request,
) -> Result<(), RequestError> {
    req.data.clear();
    req.ranges.clear();
    req.data_len = 0;
    req.sector = 0;

    // Pass 1: split into readable and writable runs, keeping them in req.data; note the
    // boundary. Bounded by seg_max + header + status descriptors.
    let max_descs = limits.seg_max.saturating_add(2);
    let mut n_readable = 0usize;
    let mut seen_writable = false;
    let mut count = 0u32;
    let mut readable_len = 0u64;
    let mut writable_len = 0u64;
    let mut order_error = false;
    for d in descs {
        count += 1;
        if count > max_descs {
            return Err(RequestError::TooManyDescriptors(max_descs));
        }
        if d.len == 0 {
            continue;
        }
        // The whole descriptor must be in guest memory; checked once here.
        if !mem.check_range(GuestAddress(d.addr), d.len as usize) {
            return Err(RequestError::BadAddress(d.addr));
        }
        if d.write_only {
            seen_writable = true;
            writable_len += u64::from(d.len);
        } else {
            if seen_writable {
                order_error = true;
            }
            n_readable += 1;
            readable_len += u64::from(d.len);
        }
        req.data.push(Segment {
            addr: GuestAddress(d.addr),
            len: d.len,
        });
    }
    if !seen_writable {
        return Err(RequestError::NoStatus);
    }
    // Status: the last byte of the last writable descriptor.
    let last = *req.data.last().ok_or(RequestError::NoStatus)?;
    if order_error {
        // Still a writable tail: report through it.
        req.status_addr = GuestAddress(last.addr.0 + u64::from(last.len) - 1);
        return Err(RequestError::ReadableAfterWritable);
    }
    req.status_addr = GuestAddress(last.addr.0 + u64::from(last.len) - 1);
    if readable_len < HEADER_LEN as u64 {
        return Err(RequestError::ShortHeader);
    }
    let mut hdr = [0u8; HEADER_LEN];
    read_from_segments(mem, &req.data[..n_readable], 0, &mut hdr)?;
    let type_ = u32::from_le_bytes([hdr[0], hdr[1], hdr[2], hdr[3]]);
    let sector = u64::from_le_bytes([
        hdr[8], hdr[9], hdr[10], hdr[11], hdr[12], hdr[13], hdr[14], hdr[15],
    ]);
    req.sector = sector;

    // Trim the segment list to the request data: drop the header bytes from the front of
    // the readable run and the status byte from the back of the writable run.
    trim_front(&mut req.data, HEADER_LEN as u64);
    let n_readable_data = count_segments_after_trim(&req.data, readable_len - HEADER_LEN as u64);
    {
        let last = req.data.last_mut().ok_or(RequestError::NoStatus)?;
        last.len -= 1;
        if last.len == 0 {
            req.data.pop();
        }
    }
    let readable_data = readable_len - HEADER_LEN as u64;
    let writable_data = writable_len - 1;

    let kind = match type_ {
        req_type::IN => RequestType::In,
        req_type::OUT => RequestType::Out,
        req_type::FLUSH => RequestType::Flush,
        req_type::GET_ID => RequestType::GetId,
        req_type::DISCARD => RequestType::Discard,
        req_type::WRITE_ZEROES => RequestType::WriteZeroes,
        other => return Err(RequestError::UnsupportedType(other)),
    };
    req.kind = kind;

    match kind {
        RequestType::In | RequestType::GetId => {
            // Data is the writable run (5.2.6.1: the driver makes it device-writable); a
            // readable data buffer would silently transfer nothing.
            if readable_data != 0 {
                return Err(RequestError::WrongDirection);
            }
            req.data.drain(..n_readable_data);
            req.data_len = writable_data;
        }
        RequestType::Out | RequestType::Discard | RequestType::WriteZeroes => {
            // Data is the readable run; the writable run must be the status byte only.
            req.data.truncate(n_readable_data);
            req.data_len = readable_data;
            if writable_data != 0 && kind == RequestType::Out {
                return Err(RequestError::WrongDirection);
            }
        }
        RequestType::Flush => {
            req.data.clear();
            req.data_len = 0;
        }
    }

    match kind {
        RequestType::In | RequestType::Out => {
            if kind == RequestType::Out && limits.read_only {
                return Err(RequestError::ReadOnly);
            }
            check_range(limits, sector, req.data_len)?;
        }
        RequestType::Flush | RequestType::GetId => {}
        RequestType::Discard | RequestType::WriteZeroes => {
            if limits.read_only {
                return Err(RequestError::ReadOnly);
            }
            parse_ranges(mem, limits, req)?;
        }
    }
    Ok(())
}

/// Remove `n` bytes from the front of the segment list.
fn trim_front(segs: &mut Vec<Segment>, mut n: u64) {
    let mut drop = 0;
    for s in segs.iter_mut() {
        if n == 0 {
            break;
        }
        let len = u64::from(s.len);
        if n >= len {
            n -= len;
            drop += 1;
        } else {
            s.addr = GuestAddress(s.addr.0 + n);
            s.len -= n as u32;
            n = 0;
        }
    }
    segs.drain(..drop);
}

/// How many leading segments hold exactly `bytes` bytes (the readable data run).
fn count_segments_after_trim(segs: &[Segment], bytes: u64) -> usize {
    let mut acc = 0u64;
    let mut n = 0;
    for s in segs {
        if acc >= bytes {
            break;
        }
        acc += u64::from(s.len);
        n += 1;
    }
    n
}

/// IN/OUT: aligned to the logical block size and inside the device (5.2.6.2).
fn check_range(limits: &DeviceLimits, sector: u64, len_bytes: u64) -> Result<(), RequestError> {
    let lbs_sectors = u64::from(limits.logical_block_size) / SECTOR_SIZE;
    if !sector.is_multiple_of(lbs_sectors)
        || !len_bytes.is_multiple_of(u64::from(limits.logical_block_size))
    {
        return Err(RequestError::Misaligned { sector, len_bytes });
    }
    let end = sector
        .checked_add(len_bytes >> SECTOR_SHIFT)
        .ok_or(RequestError::OutOfRange { sector, len_bytes })?;
    if end > limits.capacity_sectors {
        return Err(RequestError::OutOfRange { sector, len_bytes });
    }
    Ok(())
}

fn parse_ranges<M: GuestMemoryBackend>(
    mem: &M,
    limits: &DeviceLimits,
    req: &mut Request,
) -> Result<(), RequestError> {
    let discard = req.kind == RequestType::Discard;
    if req.data_len == 0 || !req.data_len.is_multiple_of(RANGE_LEN as u64) {
        return Err(RequestError::BadRangeList(req.data_len));
    }
    let n = req.data_len / RANGE_LEN as u64;
    let (max_seg, max_sectors) = if discard {
        (limits.max_discard_seg, limits.max_discard_sectors)
    } else {
        (limits.max_write_zeroes_seg, limits.max_write_zeroes_sectors)
    };
    if n > u64::from(max_seg) {
        return Err(RequestError::TooManyRanges(n));
    }
    for i in 0..n {
        let mut raw = [0u8; RANGE_LEN];
        read_from_segments(mem, &req.data, i * RANGE_LEN as u64, &mut raw)?;
        let sector = u64::from_le_bytes([
            raw[0], raw[1], raw[2], raw[3], raw[4], raw[5], raw[6], raw[7],
        ]);
        let num_sectors = u32::from_le_bytes([raw[8], raw[9], raw[10], raw[11]]);
        let flags = u32::from_le_bytes([raw[12], raw[13], raw[14], raw[15]]);
        // 5.2.6.2: for DISCARD the unmap bit and unknown flags are unsupported; for
        // WRITE_ZEROES only the unmap bit is defined.
        if (discard && flags != 0) || (!discard && flags & !RANGE_FLAG_UNMAP != 0) {
            return Err(RequestError::UnsupportedRangeFlags(flags));
        }
        if num_sectors > max_sectors {
            return Err(RequestError::RangeTooLong(num_sectors));
        }
        let len_bytes = u64::from(num_sectors) << SECTOR_SHIFT;
        check_range(limits, sector, len_bytes)?;
        req.ranges.push(Range {
            offset_bytes: sector << SECTOR_SHIFT,
            len_bytes,
            unmap: flags & RANGE_FLAG_UNMAP != 0,
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests;
