//! The server's side of the fixed newstyle handshake. Every length a client sends is checked
//! before anything is read for it; an option the server does not know gets
//! NBD_REP_ERR_UNSUP; a client that breaks the protocol (a bad magic, option data longer than
//! [`MAX_OPTION`], too many options) is closed.

use std::io::{self, Read, Write};

use super::{Export, MAX_OPTION, MAX_REQUEST};
use crate::nbd::handshake::Stream;
use crate::nbd::wire::*;

/// Options one handshake may send before it is closed.
const MAX_OPTIONS: u32 = 256;
/// Meta-context queries in one option.
const MAX_QUERIES: u32 = 64;

/// What the handshake agreed.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Session {
    /// Structured replies.
    pub structured: bool,
    /// The meta contexts selected (SET_META_CONTEXT), by id (index + 1).
    pub contexts: Vec<String>,
    /// The client asked for no zeroes after the EXPORT_NAME reply.
    no_zeroes: bool,
}

fn bad(why: &str) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, why.to_string())
}

fn reply(s: &mut Stream, opt: u32, kind: u32, data: &[u8]) -> io::Result<()> {
    let mut b = Vec::with_capacity(20 + data.len());
    b.extend_from_slice(&OPTION_REPLY_MAGIC.to_be_bytes());
    b.extend_from_slice(&opt.to_be_bytes());
    b.extend_from_slice(&kind.to_be_bytes());
    b.extend_from_slice(&(data.len() as u32).to_be_bytes());
    b.extend_from_slice(data);
    s.write_all(&b)
}

fn error_reply(s: &mut Stream, opt: u32, kind: u32, message: &str) -> io::Result<()> {
    reply(s, opt, kind, message.as_bytes())
}

/// A cursor over option data, every read checked.
struct Data<'a>(&'a [u8]);

impl<'a> Data<'a> {
    fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        if self.0.len() < n {
            return None;
        }
        let (a, b) = self.0.split_at(n);
        self.0 = b;
        Some(a)
    }
    fn u32(&mut self) -> Option<u32> {
        self.take(4)
            .map(|b| u32::from_be_bytes([b[0], b[1], b[2], b[3]]))
    }
    fn u16(&mut self) -> Option<u16> {
        self.take(2).map(|b| u16::from_be_bytes([b[0], b[1]]))
    }
    fn string(&mut self) -> Option<&'a str> {
        let n = self.u32()? as usize;
        std::str::from_utf8(self.take(n)?).ok()
    }
}

/// Is `name` this export (the empty name is the default export)?
fn is_ours(export: &dyn Export, name: &str) -> bool {
    name.is_empty() || name == export.name()
}

/// The export's transmission flags.
fn flags() -> u16 {
    FLAG_HAS_FLAGS | FLAG_READ_ONLY | FLAG_CAN_MULTI_CONN
}

/// Negotiate. Ok(Some(session)): go on to the transmission phase; Ok(None): the client
/// ended the handshake (ABORT) and the connection is closed.
pub fn negotiate(s: &mut Stream, export: &dyn Export) -> io::Result<Option<Session>> {
    let mut greeting = Vec::with_capacity(18);
    greeting.extend_from_slice(&NBDMAGIC.to_be_bytes());
    greeting.extend_from_slice(&IHAVEOPT.to_be_bytes());
    greeting.extend_from_slice(&(FLAG_FIXED_NEWSTYLE | FLAG_NO_ZEROES).to_be_bytes());
    s.write_all(&greeting)?;
    let mut cf = [0u8; 4];
    s.read_exact(&mut cf)?;
    let client_flags = u32::from_be_bytes(cf);
    if client_flags & !(FLAG_C_FIXED_NEWSTYLE | FLAG_C_NO_ZEROES) != 0 {
        return Err(bad("unknown client flags"));
    }
    let mut session = Session {
        no_zeroes: client_flags & FLAG_C_NO_ZEROES != 0,
        ..Session::default()
    };
    for _ in 0..MAX_OPTIONS {
        let mut h = [0u8; 16];
        s.read_exact(&mut h)?;
        let magic = u64::from_be_bytes(h[0..8].try_into().unwrap_or_default());
        if magic != IHAVEOPT {
            return Err(bad("bad option magic"));
        }
        let opt = u32::from_be_bytes([h[8], h[9], h[10], h[11]]);
        let len = u32::from_be_bytes([h[12], h[13], h[14], h[15]]);
        if len > MAX_OPTION {
            return Err(bad("option data too long"));
        }
        let mut data = vec![0u8; len as usize];
        s.read_exact(&mut data)?;
        match opt {
            OPT_EXPORT_NAME => {
                let name = std::str::from_utf8(&data).unwrap_or("\u{fffd}");
                if !is_ours(export, name) {
                    // No error reply exists for this option: the connection is closed.
                    return Err(bad("EXPORT_NAME of an unknown export"));
                }
                let mut b = Vec::with_capacity(134);
                b.extend_from_slice(&export.size().to_be_bytes());
                b.extend_from_slice(&flags().to_be_bytes());
                if !session.no_zeroes {
                    b.extend_from_slice(&[0u8; 124]);
                }
                s.write_all(&b)?;
                return Ok(Some(session));
            }
            OPT_ABORT => {
                let _ = reply(s, opt, REP_ACK, &[]);
                return Ok(None);
            }
            OPT_LIST => {
                if !data.is_empty() {
                    error_reply(s, opt, REP_ERR_INVALID, "LIST takes no data")?;
                    continue;
                }
                let name = export.name().as_bytes();
                let mut b = Vec::with_capacity(4 + name.len());
                b.extend_from_slice(&(name.len() as u32).to_be_bytes());
                b.extend_from_slice(name);
                reply(s, opt, REP_SERVER, &b)?;
                reply(s, opt, REP_ACK, &[])?;
            }
            OPT_INFO | OPT_GO => {
                let mut d = Data(&data);
                let parsed = (|| {
                    let name = d.string()?;
                    let n = d.u16()?;
                    let mut infos = Vec::new();
                    for _ in 0..n {
                        infos.push(d.u16()?);
                    }
                    d.0.is_empty().then_some((name, infos))
                })();
                let Some((name, infos)) = parsed else {
                    error_reply(s, opt, REP_ERR_INVALID, "malformed INFO/GO request")?;
                    continue;
                };
                if !is_ours(export, name) {
                    error_reply(s, opt, REP_ERR_UNKNOWN, "no such export")?;
                    continue;
                }
                let mut b = Vec::with_capacity(12);
                b.extend_from_slice(&INFO_EXPORT.to_be_bytes());
                b.extend_from_slice(&export.size().to_be_bytes());
                b.extend_from_slice(&flags().to_be_bytes());
                reply(s, opt, REP_INFO, &b)?;
                let mut b = Vec::with_capacity(14);
                b.extend_from_slice(&INFO_BLOCK_SIZE.to_be_bytes());
                b.extend_from_slice(&1u32.to_be_bytes());
                b.extend_from_slice(&4096u32.to_be_bytes());
                b.extend_from_slice(&MAX_REQUEST.to_be_bytes());
                reply(s, opt, REP_INFO, &b)?;
                if infos.contains(&INFO_NAME) {
                    let mut b = INFO_NAME.to_be_bytes().to_vec();
                    b.extend_from_slice(export.name().as_bytes());
                    reply(s, opt, REP_INFO, &b)?;
                }
                reply(s, opt, REP_ACK, &[])?;
                if opt == OPT_GO {
                    return Ok(Some(session));
                }
            }
            OPT_STRUCTURED_REPLY => {
                if !data.is_empty() {
                    error_reply(s, opt, REP_ERR_INVALID, "STRUCTURED_REPLY takes no data")?;
                    continue;
                }
                session.structured = true;
                reply(s, opt, REP_ACK, &[])?;
            }
            OPT_LIST_META_CONTEXT | OPT_SET_META_CONTEXT => {
                meta_context(s, opt, &data, export, &mut session)?;
            }
            _ => error_reply(s, opt, REP_ERR_UNSUP, "option not supported")?,
        }
    }
    Err(bad("too many options"))
}

/// LIST_META_CONTEXT and SET_META_CONTEXT.
fn meta_context(
    s: &mut Stream,
    opt: u32,
    data: &[u8],
    export: &dyn Export,
    session: &mut Session,
) -> io::Result<()> {
    let set = opt == OPT_SET_META_CONTEXT;
    if set && !session.structured {
        return error_reply(s, opt, REP_ERR_INVALID, "structured replies first");
    }
    let mut d = Data(data);
    let parsed = (|| {
        let name = d.string()?;
        let n = d.u32()?;
        if n > MAX_QUERIES {
            return None;
        }
        let mut queries = Vec::new();
        for _ in 0..n {
            queries.push(d.string()?);
        }
        d.0.is_empty().then_some((name, queries))
    })();
    let Some((name, queries)) = parsed else {
        return error_reply(s, opt, REP_ERR_INVALID, "malformed meta-context request");
    };
    if !is_ours(export, name) {
        return error_reply(s, opt, REP_ERR_UNKNOWN, "no such export");
    }
    let have = export.meta_contexts();
    let chosen: Vec<String> = if set {
        // Exact names only; unknown ones are left out.
        have.iter()
            .filter(|c| queries.contains(&c.as_str()))
            .cloned()
            .collect()
    } else if queries.is_empty() {
        have.clone()
    } else {
        // A query naming a namespace ("base:", "qemu:dirty-bitmap:") lists its contexts.
        have.iter()
            .filter(|c| {
                queries
                    .iter()
                    .any(|q| c.as_str() == *q || (q.ends_with(':') && c.starts_with(q)))
            })
            .cloned()
            .collect()
    };
    for (i, c) in chosen.iter().enumerate() {
        let mut b = Vec::with_capacity(4 + c.len());
        let id = if set { i as u32 + 1 } else { 0 };
        b.extend_from_slice(&id.to_be_bytes());
        b.extend_from_slice(c.as_bytes());
        reply(s, opt, REP_META_CONTEXT, &b)?;
    }
    if set {
        session.contexts = chosen;
    }
    reply(s, opt, REP_ACK, &[])
}
