//! The modes that measure something other than the workloads, one a module: each has its
//! option (`--hop`, `--seed-check`, ...) and prints a report of its own.

pub mod backup;
pub mod compress_fill;
pub mod fresh_file;
pub mod hop;
pub mod parallels_fill;
pub mod seed_check;
pub mod stream;
pub mod xts_speed;
pub mod zero_fill;
pub mod zero_scan;
