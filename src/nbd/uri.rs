//! NBD URIs (the NBD URI standard, as QEMU and libnbd's `nbdinfo` accept them):
//! `nbd://HOST[:PORT]/EXPORT` (TCP, port 10809 by default; `[v6addr]` in brackets) and
//! `nbd+unix:///EXPORT?socket=PATH` (a UNIX socket). The export name is percent-decoded.
//! `nbds://` and `nbds+unix://` (TLS) are refused with a message: vublk's NBD client has no
//! TLS.

use std::fmt;
use std::path::PathBuf;

/// The NBD protocol's default TCP port.
pub const DEFAULT_PORT: u16 = 10809;

/// Where an NBD server listens.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum NbdAddr {
    Tcp { host: String, port: u16 },
    Unix(PathBuf),
}

/// A parsed NBD URI.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NbdTarget {
    pub addr: NbdAddr,
    /// The export name ("" is the server's default export).
    pub export: String,
}

impl fmt::Display for NbdTarget {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.addr {
            NbdAddr::Tcp { host, port } if host.contains(':') => {
                write!(f, "nbd://[{host}]:{port}/{}", self.export)
            }
            NbdAddr::Tcp { host, port } => write!(f, "nbd://{host}:{port}/{}", self.export),
            NbdAddr::Unix(p) => write!(f, "nbd+unix:///{}?socket={}", self.export, p.display()),
        }
    }
}

fn percent_decode(s: &str) -> Result<String, String> {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'%' {
            let hex = s
                .get(i + 1..i + 3)
                .and_then(|h| u8::from_str_radix(h, 16).ok())
                .ok_or_else(|| format!("bad percent escape in {s:?}"))?;
            out.push(hex);
            i += 3;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    String::from_utf8(out).map_err(|_| format!("{s:?} is not UTF-8 once decoded"))
}

/// Is `s` an NBD URI at all (then [`NbdTarget::parse`] says whether it is a good one)?
pub fn is_nbd_uri(s: &str) -> bool {
    [
        "nbd://",
        "nbd+unix://",
        "nbds://",
        "nbds+unix://",
        "nbd+tcp://",
    ]
    .iter()
    .any(|p| s.starts_with(p))
}

impl NbdTarget {
    /// Parse an NBD URI; the error says what is wrong with it.
    pub fn parse(s: &str) -> Result<NbdTarget, String> {
        let bad = |why: &str| {
            Err(format!(
                "{s}: {why} (expected nbd://HOST[:PORT]/EXPORT or \
                 nbd+unix:///EXPORT?socket=PATH)"
            ))
        };
        if s.starts_with("nbds://") || s.starts_with("nbds+unix://") {
            return bad("TLS (nbds) is not supported by vublk's NBD client");
        }
        let (unix, rest) = if let Some(r) = s.strip_prefix("nbd+unix://") {
            (true, r)
        } else if let Some(r) = s
            .strip_prefix("nbd://")
            .or_else(|| s.strip_prefix("nbd+tcp://"))
        {
            (false, r)
        } else {
            return bad("not an NBD URI");
        };
        let (rest, query) = match rest.split_once('?') {
            Some((r, q)) => (r, Some(q)),
            None => (rest, None),
        };
        let (authority, path) = match rest.find('/') {
            Some(i) => (&rest[..i], &rest[i + 1..]),
            None => (rest, ""),
        };
        let export = percent_decode(path)?;
        let mut socket = None;
        for kv in query.unwrap_or("").split('&').filter(|kv| !kv.is_empty()) {
            match kv.split_once('=') {
                Some(("socket", v)) if unix => socket = Some(PathBuf::from(percent_decode(v)?)),
                _ => return bad(&format!("unsupported query parameter {kv:?}")),
            }
        }
        let addr = if unix {
            if !authority.is_empty() {
                return bad("nbd+unix:// takes no host (three slashes: nbd+unix:///EXPORT)");
            }
            match socket {
                Some(p) if !p.as_os_str().is_empty() => NbdAddr::Unix(p),
                _ => return bad("nbd+unix:// needs ?socket=PATH"),
            }
        } else {
            let (host, port) = if let Some(v6) = authority.strip_prefix('[') {
                let Some((h, after)) = v6.split_once(']') else {
                    return bad("unclosed [ in the host");
                };
                (h, after.strip_prefix(':'))
            } else {
                match authority.rsplit_once(':') {
                    Some((h, p)) => (h, Some(p)),
                    None => (authority, None),
                }
            };
            if host.is_empty() {
                return bad("no host");
            }
            let port = match port {
                None => DEFAULT_PORT,
                Some(p) => match p.parse::<u16>() {
                    Ok(n) if n > 0 => n,
                    _ => return bad(&format!("bad port {p:?}")),
                },
            };
            NbdAddr::Tcp {
                host: host.to_owned(),
                port,
            }
        };
        if export.len() > 4096 || export.contains('\0') {
            return bad("the export name is longer than 4096 bytes or contains NUL");
        }
        Ok(NbdTarget { addr, export })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tcp(host: &str, port: u16, export: &str) -> NbdTarget {
        NbdTarget {
            addr: NbdAddr::Tcp {
                host: host.into(),
                port,
            },
            export: export.into(),
        }
    }

    #[test]
    fn uris_parse_as_the_standard_writes_them() {
        assert_eq!(
            NbdTarget::parse("nbd://localhost/disk").unwrap(),
            tcp("localhost", 10809, "disk")
        );
        assert_eq!(
            NbdTarget::parse("nbd://127.0.0.1:10900/").unwrap(),
            tcp("127.0.0.1", 10900, "")
        );
        assert_eq!(
            NbdTarget::parse("nbd://[::1]:11000/a%20b").unwrap(),
            tcp("::1", 11000, "a b")
        );
        assert_eq!(
            NbdTarget::parse("nbd://host").unwrap(),
            tcp("host", 10809, "")
        );
        assert_eq!(
            NbdTarget::parse("nbd+unix:///exp?socket=/run/nbd.sock").unwrap(),
            NbdTarget {
                addr: NbdAddr::Unix("/run/nbd.sock".into()),
                export: "exp".into()
            }
        );
        assert_eq!(
            NbdTarget::parse("nbd+unix:///exp?socket=/run/nbd.sock")
                .unwrap()
                .to_string(),
            "nbd+unix:///exp?socket=/run/nbd.sock"
        );
        for bad in [
            "nbd://",
            "nbd://:10809/x",
            "nbd://h:0/x",
            "nbd://h:99999/x",
            "nbd://[::1/x",
            "nbd+unix:///x",
            "nbd+unix://host/x?socket=/s",
            "nbd://h/x?socket=/s",
            "nbd://h/%zz",
            "nbds://h/x",
            "nbds+unix:///x?socket=/s",
            "file:///x",
        ] {
            assert!(NbdTarget::parse(bad).is_err(), "{bad}");
        }
        assert!(NbdTarget::parse("nbds://h/x").unwrap_err().contains("TLS"));
        assert!(is_nbd_uri("nbds://h/x") && !is_nbd_uri("/images/x.raw"));
    }
}
