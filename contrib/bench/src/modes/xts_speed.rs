//! `--xts-speed`: the sector cipher vublk's encrypted disks use (`vublk::crypt::xts`, AES-XTS
//! over the `aes` crate), on one core: GB/s per key size and sector size, over 1 MiB
//! buffers (a large request) and 4 KiB ones (a small one), beside OpenSSL's AES-XTS as
//! `openssl speed` measures it where the command exists.

use std::time::{Duration, Instant};

use vublk::crypt::xts::Xts;

pub fn run() {
    println!("\nAES-XTS on one core (vublk::crypt::xts)\n");
    println!("| key | sector | 4 KiB buffers GB/s | 1 MiB buffers GB/s |");
    println!("|---|---:|---:|---:|");
    for key_bytes in [32usize, 64] {
        let key: Vec<u8> = (0..key_bytes as u8)
            .map(|b| b.wrapping_mul(37) ^ 0x5a)
            .collect();
        let xts = Xts::new(&key).expect("a 32 or 64-byte key");
        for sector in [512usize, 4096] {
            let rate = |len: usize| {
                let mut buf = vec![0x11u8; len];
                let t0 = Instant::now();
                let mut n = 0u64;
                while t0.elapsed() < Duration::from_millis(500) {
                    for i in 0..16u64 {
                        xts.encrypt(&mut buf, sector, i * 2048, (sector / 512) as u64);
                    }
                    n += 16;
                }
                n as f64 * len as f64 / t0.elapsed().as_secs_f64() / 1e9
            };
            println!(
                "| AES-{}-XTS | {sector} | {:.2} | {:.2} |",
                key_bytes * 4,
                rate(4096),
                rate(1 << 20)
            );
        }
    }
    for (name, sector) in [("aes-256-xts", 512), ("aes-256-xts", 4096)] {
        let out = std::process::Command::new("openssl")
            .args(["speed", "-evp", name, "-seconds", "1", "-bytes"])
            .arg(sector.to_string())
            .output();
        if let Some(o) = out.ok().filter(|o| o.status.success()) {
            let text = String::from_utf8_lossy(&o.stdout);
            if let Some(kbs) = text
                .lines()
                .last()
                .and_then(|l| l.split_whitespace().last())
                .and_then(|v| v.trim_end_matches('k').parse::<f64>().ok())
            {
                println!(
                    "\nOpenSSL {name}, {sector}-byte units (`openssl speed -evp`): {:.2} GB/s",
                    kbs * 1000.0 / 1e9
                );
            }
        }
    }
}
