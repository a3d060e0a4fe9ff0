//! `vublk create`'s options checked (as [`super::Config::from_args`] checks the daemon's):
//! the error names the option; `--encrypt`'s passphrase is read here.

use crate::image::Format;

/// `vublk create`'s options checked, the one place they are (as [`Config::from_args`] is
/// for serving); the error names the option.
pub fn create_request(
    a: &crate::args::CreateArgs,
) -> Result<crate::image::create::CreateRequest, String> {
    use crate::args::parse_size;
    let parallels = a.format == Format::Parallels;
    let cs = a
        .cluster_size
        .as_deref()
        .unwrap_or(if parallels { "1M" } else { "64K" });
    let cluster = if parallels {
        parse_size(cs)
            .filter(|c| *c > 0 && c % 512 == 0 && *c <= 1 << 30)
            .ok_or_else(|| format!("--cluster-size {cs}: must be a multiple of 512 up to 1G"))?
    } else {
        parse_size(cs)
            .filter(|c| c.is_power_of_two() && (512..=2 << 20).contains(c))
            .ok_or_else(|| format!("--cluster-size {cs}: must be a power of two from 512 to 2M"))?
    };
    if a.extended_l2 && a.format != Format::Qcow2 {
        return Err("--extended-l2 needs --format qcow2".into());
    }
    if a.extended_l2 && cluster < 16 << 10 {
        return Err(format!(
            "--extended-l2 with --cluster-size {cs}: subclusters need clusters of 16K at least"
        ));
    }
    if a.backing.is_some() && a.format != Format::Qcow2 {
        return Err("--backing needs --format qcow2".into());
    }
    let size_bytes = match &a.size {
        Some(s) => Some(
            parse_size(s)
                .filter(|n| *n > 0 && n % 512 == 0)
                .ok_or_else(|| {
                    format!("--size {s}: expected e.g. 8G, 512M or bytes, a multiple of 512")
                })?,
        ),
        None => None,
    };
    if let (true, Some(n)) = (parallels, size_bytes) {
        // A BAT too large to open: refused before any file exists.
        crate::image::parallels::new_header(n, cluster).map_err(|e| {
            let size = a.size.as_deref().unwrap_or_default();
            format!("--size {size} with --cluster-size {cs}: {e}")
        })?;
    }
    let encrypt = match (a.encrypt, &a.key_secret) {
        (Some(version), Some(src)) => Some(encrypt_request(a, version, src)?),
        _ => None,
    };
    Ok(crate::image::create::CreateRequest {
        encrypt,
        format: a.format,
        size_bytes,
        cluster,
        compression: a.compression_type,
        extended_l2: a.extended_l2,
        backing: a.backing.clone(),
        file: a.file.clone(),
    })
}

/// `vublk create --encrypt`'s options checked, the passphrase read.
fn encrypt_request(
    a: &crate::args::CreateArgs,
    version: crate::crypt::format::LuksVersion,
    src: &crate::crypt::KeySource,
) -> Result<crate::image::create::Encrypt, String> {
    use crate::crypt::format::{FormatParams, KdfChoice, LuksVersion};
    if !matches!(a.format, Format::Raw | Format::Luks | Format::Qcow2) {
        return Err(format!(
            "--encrypt: makes a LUKS volume of raw data (--format raw or luks) or an \
             encrypted qcow2 image (--format qcow2), not {:?}",
            a.format
        ));
    }
    if a.format == Format::Qcow2 {
        if a.backing.is_some() {
            return Err(
                "--encrypt with --backing: encrypted qcow2 images with a backing \
                        file are not supported"
                    .into(),
            );
        }
        if a.sector_size != 512 {
            return Err(format!(
                "--sector-size {}: an encrypted qcow2 image encrypts 512-byte sectors",
                a.sector_size
            ));
        }
    }
    let kdf = a.kdf.unwrap_or(match version {
        LuksVersion::Luks1 => KdfChoice::Pbkdf2,
        LuksVersion::Luks2 => KdfChoice::Argon2id,
    });
    if version == LuksVersion::Luks1 && kdf != KdfChoice::Pbkdf2 {
        return Err("--kdf: LUKS1 key slots use pbkdf2".into());
    }
    if !matches!(a.key_bits, 256 | 512) {
        return Err(format!("--key-bits {}: 256 or 512", a.key_bits));
    }
    let sector_ok = match version {
        LuksVersion::Luks1 => a.sector_size == 512,
        LuksVersion::Luks2 => matches!(a.sector_size, 512 | 1024 | 2048 | 4096),
    };
    if !sector_ok {
        return Err(format!(
            "--sector-size {}: LUKS1 encrypts 512-byte sectors, LUKS2 512 to 4096",
            a.sector_size
        ));
    }
    let memory_kib = crate::args::parse_size(&a.kdf_memory)
        .map(|b| b / 1024)
        .filter(|&k| (8..=u64::from(crate::crypt::kdf::MAX_ARGON2_MEMORY_KIB)).contains(&k))
        .ok_or_else(|| format!("--kdf-memory {}: from 8K to 4G", a.kdf_memory))?
        as u32;
    if !(1..=crate::crypt::kdf::MAX_ARGON2_LANES).contains(&a.kdf_lanes) {
        return Err(format!("--kdf-lanes {}: 1 to 16", a.kdf_lanes));
    }
    if let Some(n) = a.kdf_iterations {
        let ok = match kdf {
            KdfChoice::Pbkdf2 => (1000..=crate::crypt::kdf::MAX_PBKDF2_ITERATIONS).contains(&n),
            _ => (1..=1000).contains(&n),
        };
        if !ok {
            return Err(format!(
                "--kdf-iterations {n}: PBKDF2 1000 to {}, Argon2 1 to 1000 passes",
                crate::crypt::kdf::MAX_PBKDF2_ITERATIONS
            ));
        }
    }
    if !(1..=60_000).contains(&a.iter_time) {
        return Err(format!("--iter-time {}: 1 to 60000 ms", a.iter_time));
    }
    let secret = src.read().map_err(|e| format!("--key-secret {src}: {e}"))?;
    if secret.is_empty() {
        return Err(format!("--key-secret {src}: empty"));
    }
    Ok(crate::image::create::Encrypt {
        params: FormatParams {
            version,
            key_bytes: a.key_bits as usize / 8,
            sector_size: a.sector_size,
            kdf,
            iter_time_ms: a.iter_time,
            iterations: a.kdf_iterations,
            memory_kib,
            lanes: a.kdf_lanes,
        },
        passphrase: std::sync::Arc::new(secret),
    })
}
