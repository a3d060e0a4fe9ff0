//! What the RBD driver is told: the image (`rbd:POOL/IMAGE[@SNAPSHOT]`) and how the cluster
//! is reached and cached. Built without the `rbd` feature too, so that the options parse and
//! a build without librbd refuses an RBD image with the reason.

use std::path::PathBuf;
use std::time::Duration;

/// `rbd:POOL/IMAGE[@SNAPSHOT]`, QEMU's pseudo-protocol.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RbdSpec {
    pub pool: String,
    pub image: String,
    pub snapshot: Option<String>,
}

impl RbdSpec {
    /// Parse `rbd:POOL/IMAGE[@SNAPSHOT]`; None if `s` does not start with `rbd:`.
    pub fn parse(s: &str) -> Option<Result<RbdSpec, String>> {
        let rest = s.strip_prefix("rbd:")?;
        let bad = || Err(format!("{s}: expected rbd:POOL/IMAGE[@SNAPSHOT]"));
        let Some((pool, image)) = rest.split_once('/') else {
            return Some(bad());
        };
        let (image, snapshot) = match image.split_once('@') {
            Some((i, s)) => (i, Some(s.to_owned())),
            None => (image, None),
        };
        let ok = |x: &str| !x.is_empty() && !x.contains(['/', '@', ':', '\0']);
        if !ok(pool) || !ok(image) || snapshot.as_deref().is_some_and(|s| !ok(s)) {
            return Some(bad());
        }
        Some(Ok(RbdSpec {
            pool: pool.to_owned(),
            image: image.to_owned(),
            snapshot,
        }))
    }
}

/// `--ceph-conf`, `--ceph-id`, `--ceph-keyring`, `--ceph-timeout`, `--ceph-op-timeout`,
/// `--ceph-lock-wait`, and
/// librbd's cache as `--cache` sets it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CephOptions {
    pub conf: PathBuf,
    /// The client name without `client.`.
    pub id: String,
    pub keyring: Option<PathBuf>,
    /// Connecting gives up after this long.
    pub timeout: Duration,
    /// A data-path operation the cluster does not answer fails after this long (zero: it
    /// waits for ever).
    pub op_timeout: Duration,
    /// How long opening waits for another client to give up the exclusive lock.
    pub lock_wait: Duration,
    pub cache: RbdCache,
}

impl Default for CephOptions {
    fn default() -> Self {
        CephOptions {
            conf: "/etc/ceph/ceph.conf".into(),
            id: "admin".into(),
            keyring: None,
            timeout: Duration::from_secs(10),
            op_timeout: Duration::from_secs(30),
            lock_wait: Duration::from_secs(45),
            cache: RbdCache::Off,
        }
    }
}

/// librbd's cache (`rbd_cache`), from `--cache`: none = off, writeback, writethrough (reads
/// cached, writes not).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RbdCache {
    Off,
    Writeback,
    Writethrough,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn specs_parse_as_qemu_writes_them() {
        assert_eq!(RbdSpec::parse("/img.raw"), None);
        assert_eq!(
            RbdSpec::parse("rbd:pool/disk").unwrap().unwrap(),
            RbdSpec {
                pool: "pool".into(),
                image: "disk".into(),
                snapshot: None
            }
        );
        assert_eq!(
            RbdSpec::parse("rbd:pool/disk@snap1")
                .unwrap()
                .unwrap()
                .snapshot,
            Some("snap1".into())
        );
        for bad in [
            "rbd:",
            "rbd:pool",
            "rbd:/disk",
            "rbd:pool/",
            "rbd:pool/a/b",
            "rbd:p/d@",
        ] {
            assert!(RbdSpec::parse(bad).unwrap().is_err(), "{bad}");
        }
    }
}
