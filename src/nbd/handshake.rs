//! Connecting to an NBD server: the fixed newstyle handshake, structured replies, and
//! `NBD_OPT_GO` with the export's size, transmission flags and block-size constraints. Done
//! blocking, with a deadline, before the data phase (which runs on the queue's own loop).

use std::io::{self, Read, Write};
use std::net::{TcpStream, ToSocketAddrs};
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::net::UnixStream;
use std::time::{Duration, Instant};

use super::uri::{NbdAddr, NbdTarget};
use super::wire::*;

/// A connected socket, TCP or UNIX.
#[derive(Debug)]
pub enum Stream {
    Tcp(TcpStream),
    Unix(UnixStream),
}

impl Stream {
    pub(crate) fn set_read_timeout(&self, t: Option<Duration>) -> io::Result<()> {
        match self {
            Stream::Tcp(s) => s.set_read_timeout(t),
            Stream::Unix(s) => s.set_read_timeout(t),
        }
    }

    pub(crate) fn set_write_timeout(&self, t: Option<Duration>) -> io::Result<()> {
        match self {
            Stream::Tcp(s) => s.set_write_timeout(t),
            Stream::Unix(s) => s.set_write_timeout(t),
        }
    }

    pub(crate) fn try_clone(&self) -> io::Result<Stream> {
        Ok(match self {
            Stream::Tcp(s) => Stream::Tcp(s.try_clone()?),
            Stream::Unix(s) => Stream::Unix(s.try_clone()?),
        })
    }

    /// Shut both directions down (a blocked reader or writer on another thread returns).
    pub(crate) fn shutdown(&self) {
        let _ = match self {
            Stream::Tcp(s) => s.shutdown(std::net::Shutdown::Both),
            Stream::Unix(s) => s.shutdown(std::net::Shutdown::Both),
        };
    }

    fn set_timeouts(&self, t: Option<Duration>) -> io::Result<()> {
        match self {
            Stream::Tcp(s) => {
                s.set_read_timeout(t)?;
                s.set_write_timeout(t)
            }
            Stream::Unix(s) => {
                s.set_read_timeout(t)?;
                s.set_write_timeout(t)
            }
        }
    }

    pub fn set_nonblocking(&self, on: bool) -> io::Result<()> {
        match self {
            Stream::Tcp(s) => s.set_nonblocking(on),
            Stream::Unix(s) => s.set_nonblocking(on),
        }
    }
}

impl AsRawFd for Stream {
    fn as_raw_fd(&self) -> RawFd {
        match self {
            Stream::Tcp(s) => s.as_raw_fd(),
            Stream::Unix(s) => s.as_raw_fd(),
        }
    }
}

impl Read for Stream {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match self {
            Stream::Tcp(s) => s.read(buf),
            Stream::Unix(s) => s.read(buf),
        }
    }
}

impl Write for Stream {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        match self {
            Stream::Tcp(s) => s.write(buf),
            Stream::Unix(s) => s.write(buf),
        }
    }
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// What the server said about the export.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Export {
    pub size: u64,
    /// Transmission flags (`NBD_FLAG_*`).
    pub flags: u16,
    /// Block-size constraints (1 / 4096 / 32 MiB where the server gave none).
    pub min_block: u32,
    pub preferred_block: u32,
    pub max_block: u32,
    /// Structured replies were negotiated.
    pub structured: bool,
}

impl Export {
    pub fn has(&self, flag: u16) -> bool {
        self.flags & flag != 0
    }
}

/// Why connecting failed.
#[derive(Debug, thiserror::Error)]
pub enum ConnectError {
    #[error("connecting to {target}: {source}")]
    Connect {
        target: String,
        #[source]
        source: io::Error,
    },
    #[error("{target}: the handshake failed: {source}")]
    Io {
        target: String,
        #[source]
        source: io::Error,
    },
    #[error("{target}: {what}")]
    Protocol { target: String, what: String },
}

fn connect_socket(t: &NbdTarget, deadline: Instant) -> io::Result<Stream> {
    let left = || {
        deadline
            .checked_duration_since(Instant::now())
            .filter(|d| !d.is_zero())
            .ok_or_else(|| io::Error::new(io::ErrorKind::TimedOut, "timed out"))
    };
    match &t.addr {
        NbdAddr::Unix(p) => Ok(Stream::Unix(UnixStream::connect(p)?)),
        NbdAddr::Tcp { host, port } => {
            let mut last = io::Error::new(io::ErrorKind::NotFound, "the host has no address");
            for a in (host.as_str(), *port).to_socket_addrs()? {
                match TcpStream::connect_timeout(&a, left()?) {
                    Ok(s) => {
                        s.set_nodelay(true)?;
                        return Ok(Stream::Tcp(s));
                    }
                    Err(e) => last = e,
                }
            }
            Err(last)
        }
    }
}

fn read_exact(s: &mut Stream, n: usize) -> io::Result<Vec<u8>> {
    let mut v = vec![0u8; n];
    s.read_exact(&mut v)?;
    Ok(v)
}

fn be64(b: &[u8]) -> u64 {
    u64::from_be_bytes(b[..8].try_into().unwrap_or([0; 8]))
}
fn be32(b: &[u8]) -> u32 {
    u32::from_be_bytes(b[..4].try_into().unwrap_or([0; 4]))
}
fn be16(b: &[u8]) -> u16 {
    u16::from_be_bytes(b[..2].try_into().unwrap_or([0; 2]))
}

/// Longest option reply payload accepted (a server's description or name; hostile servers
/// must not make vublk allocate without bound).
const MAX_OPTION_REPLY: u32 = 64 << 10;

struct OptReply {
    kind: u32,
    data: Vec<u8>,
}

fn send_option(s: &mut Stream, opt: u32, data: &[u8]) -> io::Result<()> {
    let mut m = Vec::with_capacity(16 + data.len());
    m.extend_from_slice(&IHAVEOPT.to_be_bytes());
    m.extend_from_slice(&opt.to_be_bytes());
    m.extend_from_slice(&(data.len() as u32).to_be_bytes());
    m.extend_from_slice(data);
    s.write_all(&m)
}

fn read_option_reply(s: &mut Stream, opt: u32) -> Result<OptReply, String> {
    let h = read_exact(s, 20).map_err(|e| format!("reading an option reply: {e}"))?;
    if be64(&h) != OPTION_REPLY_MAGIC {
        return Err("bad option reply magic (not an NBD server?)".into());
    }
    if be32(&h[8..]) != opt {
        return Err(format!(
            "a reply to option {} while asking {opt}",
            be32(&h[8..])
        ));
    }
    let (kind, len) = (be32(&h[12..]), be32(&h[16..]));
    if len > MAX_OPTION_REPLY {
        return Err(format!("an option reply of {len} bytes"));
    }
    let data = read_exact(s, len as usize).map_err(|e| format!("reading an option reply: {e}"))?;
    Ok(OptReply { kind, data })
}

fn rep_error_name(kind: u32) -> String {
    match kind {
        REP_ERR_UNSUP => "not supported".into(),
        REP_ERR_POLICY => "refused by the server's policy".into(),
        REP_ERR_INVALID => "invalid".into(),
        REP_ERR_PLATFORM => "not supported on the server's platform".into(),
        REP_ERR_TLS_REQD => "the server requires TLS (not supported by vublk)".into(),
        REP_ERR_UNKNOWN => "no such export".into(),
        REP_ERR_SHUTDOWN => "the server is shutting down".into(),
        REP_ERR_BLOCK_SIZE_REQD => "the server requires block-size negotiation".into(),
        REP_ERR_TOO_BIG => "too big".into(),
        k => format!("error {k:#x}"),
    }
}

/// End the session politely (NBD_CMD_DISC) and close the socket.
pub fn disconnect(mut s: Stream) {
    let _ = s.write_all(&Request::disc().encode());
}

/// Connect and negotiate, giving up after `timeout`. Returns the stream (blocking, no
/// timeouts) and what the server said about the export.
pub fn connect(target: &NbdTarget, timeout: Duration) -> Result<(Stream, Export), ConnectError> {
    let name = target.to_string();
    let deadline = Instant::now() + timeout;
    let mut s = connect_socket(target, deadline).map_err(|source| ConnectError::Connect {
        target: name.clone(),
        source,
    })?;
    let io_err = |source: io::Error| ConnectError::Io {
        target: name.clone(),
        source: match source.kind() {
            io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => io::Error::new(
                io::ErrorKind::TimedOut,
                format!("no answer within {timeout:?}"),
            ),
            _ => source,
        },
    };
    let proto = |what: String| ConnectError::Protocol {
        target: name.clone(),
        what,
    };
    s.set_timeouts(Some(timeout.max(Duration::from_millis(100))))
        .map_err(io_err)?;
    let hello = read_exact(&mut s, 18).map_err(io_err)?;
    if be64(&hello) != NBDMAGIC {
        return Err(proto("not an NBD server (no NBDMAGIC)".into()));
    }
    if be64(&hello[8..]) != IHAVEOPT {
        return Err(proto(
            "the server speaks the oldstyle protocol, which vublk does not".into(),
        ));
    }
    let hflags = be16(&hello[16..]);
    if hflags & FLAG_FIXED_NEWSTYLE == 0 {
        return Err(proto("the server does not speak fixed newstyle".into()));
    }
    let mut cflags = FLAG_C_FIXED_NEWSTYLE;
    if hflags & FLAG_NO_ZEROES != 0 {
        cflags |= FLAG_C_NO_ZEROES;
    }
    s.write_all(&cflags.to_be_bytes()).map_err(io_err)?;

    // Structured replies: reads answered in chunks, errors with messages.
    send_option(&mut s, OPT_STRUCTURED_REPLY, &[]).map_err(io_err)?;
    let r = read_option_reply(&mut s, OPT_STRUCTURED_REPLY).map_err(&proto)?;
    let structured = r.kind == REP_ACK;

    // GO: the export, asking for its block-size constraints.
    let mut go = Vec::new();
    go.extend_from_slice(&(target.export.len() as u32).to_be_bytes());
    go.extend_from_slice(target.export.as_bytes());
    go.extend_from_slice(&1u16.to_be_bytes());
    go.extend_from_slice(&INFO_BLOCK_SIZE.to_be_bytes());
    send_option(&mut s, OPT_GO, &go).map_err(io_err)?;
    let mut export = None;
    let (mut min, mut pref, mut max) = (1u32, 4096u32, 32u32 << 20);
    loop {
        let r = read_option_reply(&mut s, OPT_GO).map_err(&proto)?;
        match r.kind {
            REP_ACK => break,
            REP_INFO if r.data.len() >= 2 => match be16(&r.data) {
                INFO_EXPORT if r.data.len() >= 12 => {
                    export = Some((be64(&r.data[2..]), be16(&r.data[10..])));
                }
                INFO_BLOCK_SIZE if r.data.len() >= 14 => {
                    (min, pref, max) =
                        (be32(&r.data[2..]), be32(&r.data[6..]), be32(&r.data[10..]));
                }
                _ => {}
            },
            REP_INFO => return Err(proto("a short NBD_REP_INFO".into())),
            k if k & REP_FLAG_ERROR != 0 => {
                let msg = String::from_utf8_lossy(&r.data).trim().to_owned();
                return Err(proto(format!(
                    "export {:?}: {}{}",
                    target.export,
                    rep_error_name(k),
                    if msg.is_empty() {
                        String::new()
                    } else {
                        format!(" ({msg})")
                    }
                )));
            }
            _ => {}
        }
    }
    let Some((size, flags)) = export else {
        return Err(proto("the server sent no export information".into()));
    };
    // Constraints as the protocol allows them: powers of two, min <= pref <= max.
    let sane = min.is_power_of_two()
        && min <= 65536
        && pref.is_power_of_two()
        && pref >= min
        && max >= pref.max(min)
        && (max == u32::MAX || max % min == 0);
    if !sane {
        return Err(proto(format!(
            "nonsensical block sizes: minimum {min}, preferred {pref}, maximum {max}"
        )));
    }
    if flags & FLAG_HAS_FLAGS == 0 {
        return Err(proto("the export's flags lack NBD_FLAG_HAS_FLAGS".into()));
    }
    s.set_timeouts(None).map_err(io_err)?;
    Ok((
        s,
        Export {
            size,
            flags,
            min_block: min,
            preferred_block: pref,
            max_block: max.min(32 << 20),
            structured,
        },
    ))
}
