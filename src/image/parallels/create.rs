//! New, empty parallels images (`vublk create --format parallels`, and tests): the header,
//! with nothing the size of the BAT built in memory.

use super::{HEADER_LEN, MAGIC_EXT, MAX_BAT_ENTRIES, MAX_CLUSTER, VERSION};

/// A new, empty parallels image (new magic, as `qemu-img create -f parallels` makes them):
/// its header, and its data offset (the BAT after the header reads as zeroes up to there, so
/// the caller writes the header and extends the file; nothing the size of the BAT is built
/// in memory). The BAT may have at most [`MAX_BAT_ENTRIES`], so that the image opens.
pub fn new_header(size_bytes: u64, cluster: u64) -> Result<([u8; 64], u64), String> {
    if cluster == 0 || !cluster.is_multiple_of(512) || cluster > MAX_CLUSTER {
        return Err(format!(
            "cluster size {cluster}: must be a multiple of 512 up to 1G"
        ));
    }
    if size_bytes == 0 || !size_bytes.is_multiple_of(512) {
        return Err("size must be a positive multiple of 512 bytes".into());
    }
    let nb_bat = size_bytes.div_ceil(cluster);
    if nb_bat > MAX_BAT_ENTRIES {
        return Err(format!(
            "{size_bytes} bytes in clusters of {cluster} need {nb_bat} BAT entries; vublk (like \
             QEMU) opens at most {MAX_BAT_ENTRIES}: use clusters of at least {} bytes",
            min_cluster(size_bytes)
        ));
    }
    let tracks = cluster / 512;
    let bat_sectors = (HEADER_LEN + nb_bat * 4).div_ceil(512);
    let data_sectors = bat_sectors.next_multiple_of(tracks);
    let data_off = u32::try_from(data_sectors).map_err(|_| "the BAT is too large")?;
    let nb_sectors = size_bytes / 512;
    let mut b = [0u8; HEADER_LEN as usize];
    b[..16].copy_from_slice(MAGIC_EXT);
    b[16..20].copy_from_slice(&VERSION.to_le_bytes());
    b[20..24].copy_from_slice(&16u32.to_le_bytes());
    let cylinders = u32::try_from(nb_sectors / (16 * 32)).unwrap_or(u32::MAX);
    b[24..28].copy_from_slice(&cylinders.to_le_bytes());
    b[28..32].copy_from_slice(&(tracks as u32).to_le_bytes());
    b[32..36].copy_from_slice(&(nb_bat as u32).to_le_bytes());
    b[36..44].copy_from_slice(&nb_sectors.to_le_bytes());
    b[48..52].copy_from_slice(&data_off.to_le_bytes());
    Ok((b, data_sectors * 512))
}

/// The smallest cluster size (a multiple of 512) whose BAT for `size_bytes` opens.
pub fn min_cluster(size_bytes: u64) -> u64 {
    let mut c = size_bytes.div_ceil(MAX_BAT_ENTRIES).next_multiple_of(512);
    while size_bytes.div_ceil(c) > MAX_BAT_ENTRIES {
        c += 512;
    }
    c
}

/// A new, empty parallels image's bytes: [`new_header`] and the zeroed BAT (for small images,
/// in tests; `vublk create` extends the file instead).
pub fn new_image(size_bytes: u64, cluster: u64) -> Result<Vec<u8>, String> {
    let (header, data_off) = new_header(size_bytes, cluster)?;
    let mut b = header.to_vec();
    b.resize(data_off as usize, 0);
    Ok(b)
}
