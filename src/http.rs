//! The metrics endpoint's HTTP/1.1 server: small on purpose (a GET without a body, one answer
//! per connection, then `Connection: close`), and everything a client can make it spend is
//! bounded, so nothing a client does, or fails to do, reaches the rest of the daemon:
//! - at most [`Limits::connections`] connections at once, a thread each; one more is answered
//!   503 and closed at once, never queued;
//! - a request head (request line and headers) of at most [`Limits::head_bytes`] bytes and
//!   [`MAX_HEADERS`] headers, else 431 (httparse parses the head in place and stores nothing);
//! - [`Limits::head_timeout`] from connecting to the end of the head (a client trickling a
//!   byte at a time does not extend it), else 408; [`Limits::write_timeout`] for the answer;
//! - a failing accept (EMFILE, ENFILE, ENOBUFS, ENOMEM) is waited out: a pause of
//!   [`ACCEPT_BACKOFF`] and a rate-limited log line; the endpoint never ends.

use std::io::{self, Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Most headers in a request head; more get 431.
pub const MAX_HEADERS: usize = 32;
/// The pause after a failed accept (out of file descriptors or memory): the listening socket
/// stays readable while the connection waits in the backlog, so retrying at once would spin.
pub const ACCEPT_BACKOFF: Duration = Duration::from_millis(100);
/// After the answer: how long, and how many bytes, to read and drop what the client still
/// sends before closing (closing with unread data resets the connection, and the client
/// could lose the answer).
const LINGER: Duration = Duration::from_secs(1);
const LINGER_BYTES: usize = 64 * 1024;

/// What one client may cost.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// Connections served at once.
    pub connections: usize,
    /// Longest request head, in bytes.
    pub head_bytes: usize,
    /// From connecting to the end of the request head.
    pub head_timeout: Duration,
    /// Writing the answer.
    pub write_timeout: Duration,
}

/// The metrics endpoint's limits.
pub const LIMITS: Limits = Limits {
    connections: 16,
    head_bytes: 8 * 1024,
    head_timeout: Duration::from_secs(5),
    write_timeout: Duration::from_secs(5),
};

/// A parsed request: all a handler sees.
#[derive(Debug)]
pub struct Request<'a> {
    pub method: &'a str,
    /// The request target as sent (path and query).
    pub path: &'a str,
}

/// An answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Response {
    pub status: u16,
    pub content_type: &'static str,
    /// More header lines, e.g. `("Allow", "GET")`.
    pub headers: Vec<(&'static str, &'static str)>,
    pub body: String,
}

impl Response {
    /// A plain-text answer.
    pub fn text(status: u16, body: impl Into<String>) -> Self {
        Response {
            status,
            content_type: "text/plain; charset=utf-8",
            headers: Vec::new(),
            body: body.into(),
        }
    }

    fn to_bytes(&self) -> Vec<u8> {
        let mut head = format!(
            "HTTP/1.1 {} {}\r\nContent-Type: {}\r\nContent-Length: {}\r\nConnection: close\r\n",
            self.status,
            reason(self.status),
            self.content_type,
            self.body.len()
        );
        for (name, value) in &self.headers {
            head.push_str(&format!("{name}: {value}\r\n"));
        }
        head.push_str("\r\n");
        let mut out = head.into_bytes();
        out.extend_from_slice(self.body.as_bytes());
        out
    }
}

fn reason(status: u16) -> &'static str {
    match status {
        200 => "OK",
        400 => "Bad Request",
        404 => "Not Found",
        405 => "Method Not Allowed",
        408 => "Request Timeout",
        431 => "Request Header Fields Too Large",
        503 => "Service Unavailable",
        _ => "",
    }
}

/// Serve `listener` on a thread of its own for the life of the process, each request
/// answered by `handler`.
pub fn spawn<H>(listener: TcpListener, limits: Limits, handler: H) -> io::Result<()>
where
    H: Fn(&Request) -> Response + Send + Sync + 'static,
{
    let handler = Arc::new(handler);
    std::thread::Builder::new()
        .name("vublk-metrics".into())
        .spawn(move || accept_loop(&listener, limits, handler))?;
    Ok(())
}

/// One of the connections served at once; its drop frees the place.
struct Slot(Arc<AtomicUsize>);

impl Slot {
    fn take(active: &Arc<AtomicUsize>, max: usize) -> Option<Slot> {
        active
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < max).then_some(n + 1)
            })
            .ok()
            .map(|_| Slot(active.clone()))
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

fn accept_loop<H>(listener: &TcpListener, limits: Limits, handler: Arc<H>)
where
    H: Fn(&Request) -> Response + Send + Sync + 'static,
{
    let active = Arc::new(AtomicUsize::new(0));
    let busy = Response::text(503, "too many connections; try again\n").to_bytes();
    loop {
        let conn = match listener.accept() {
            Ok((conn, _)) => conn,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => {
                crate::log_limited!(
                    log::Level::Warn,
                    "metrics: accepting a connection: {e}; trying again in {} ms",
                    ACCEPT_BACKOFF.as_millis()
                );
                std::thread::sleep(ACCEPT_BACKOFF);
                continue;
            }
        };
        let Some(slot) = Slot::take(&active, limits.connections) else {
            crate::log_limited!(
                log::Level::Warn,
                "metrics: {} connections already; one more answered 503",
                limits.connections
            );
            // One try that never blocks: the answer fits in an empty socket buffer.
            if conn.set_nonblocking(true).is_ok() {
                let _ = (&conn).write(&busy);
            }
            continue;
        };
        let handler = handler.clone();
        let spawned = std::thread::Builder::new()
            .name("vublk-scrape".into())
            .spawn(move || {
                let _slot = slot;
                serve_connection(conn, limits, &*handler);
            });
        // A failed spawn drops the closure, and with it the connection and its slot.
        if let Err(e) = spawned {
            crate::log_limited!(
                log::Level::Warn,
                "metrics: cannot start a connection thread: {e}"
            );
        }
    }
}

/// Does `bytes` hold the empty line that ends a request head?
fn ends_head(bytes: &[u8]) -> bool {
    bytes.windows(2).any(|w| w == b"\n\n") || bytes.windows(3).any(|w| w == b"\n\r\n")
}

/// Read one request head (bounded in size and time), answer it, close.
fn serve_connection(mut conn: TcpStream, limits: Limits, handler: &dyn Fn(&Request) -> Response) {
    let deadline = Instant::now() + limits.head_timeout;
    let mut buf = vec![0u8; limits.head_bytes];
    let mut len = 0;
    let too_large = || {
        Response::text(
            431,
            format!(
                "request head over {} bytes or {MAX_HEADERS} headers\n",
                limits.head_bytes
            ),
        )
    };
    let response = loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() || conn.set_read_timeout(Some(left)).is_err() {
            break Response::text(408, "request head not received in time\n");
        }
        let n = match conn.read(&mut buf[len..]) {
            Ok(0) => return,
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                ) =>
            {
                continue
            }
            Err(_) => return,
        };
        // Parse only once the head can be complete (the end may straddle two reads).
        let from = len.saturating_sub(2);
        len += n;
        if !ends_head(&buf[from..len]) {
            if len == buf.len() {
                break too_large();
            }
            continue;
        }
        let mut headers = [httparse::EMPTY_HEADER; MAX_HEADERS];
        let mut req = httparse::Request::new(&mut headers);
        match req.parse(&buf[..len]) {
            Ok(httparse::Status::Complete(_)) => {
                break handler(&Request {
                    method: req.method.unwrap_or_default(),
                    path: req.path.unwrap_or_default(),
                })
            }
            Ok(httparse::Status::Partial) if len < buf.len() => continue,
            Ok(httparse::Status::Partial) | Err(httparse::Error::TooManyHeaders) => {
                break too_large()
            }
            Err(e) => break Response::text(400, format!("bad request: {e}\n")),
        }
    };
    if write_all_by(&mut conn, &response.to_bytes(), limits.write_timeout).is_err() {
        return;
    }
    // Our end is done; read and drop what the client still sends (briefly, boundedly) so
    // the close does not reset the connection under the answer.
    let _ = conn.shutdown(Shutdown::Write);
    let until = Instant::now() + LINGER;
    let mut drained = 0;
    while drained < LINGER_BYTES {
        let left = until.saturating_duration_since(Instant::now());
        if left.is_zero() || conn.set_read_timeout(Some(left)).is_err() {
            break;
        }
        match conn.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => drained += n,
        }
    }
}

/// `write_all` that gives up once `timeout` has passed in all (a slow reader cannot stretch
/// it write by write).
fn write_all_by(conn: &mut TcpStream, mut bytes: &[u8], timeout: Duration) -> io::Result<()> {
    let deadline = Instant::now() + timeout;
    while !bytes.is_empty() {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(io::ErrorKind::TimedOut.into());
        }
        conn.set_write_timeout(Some(left))?;
        match conn.write(bytes) {
            Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
            Ok(n) => bytes = &bytes[n..],
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                ) => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    const SHORT: Limits = Limits {
        connections: 2,
        head_bytes: 1024,
        head_timeout: Duration::from_millis(500),
        write_timeout: Duration::from_secs(5),
    };

    /// A server on a free port whose handler echoes the method and path.
    fn server() -> String {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap().to_string();
        spawn(l, SHORT, |r| {
            Response::text(200, format!("{} {}", r.method, r.path))
        })
        .unwrap();
        addr
    }

    /// Send `bytes`, then read the answer until the server closes.
    fn exchange(addr: &str, bytes: &[u8]) -> String {
        let mut s = TcpStream::connect(addr).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        let _ = s.write_all(bytes);
        let mut out = Vec::new();
        let _ = s.read_to_end(&mut out);
        String::from_utf8_lossy(&out).into_owned()
    }

    #[test]
    fn a_request_gets_the_handlers_answer_and_the_connection_closed() {
        let addr = server();
        let a = exchange(&addr, b"GET /metrics?x=1 HTTP/1.1\r\nHost: h\r\n\r\n");
        assert_eq!(
            a,
            "HTTP/1.1 200 OK\r\nContent-Type: text/plain; charset=utf-8\r\n\
             Content-Length: 16\r\nConnection: close\r\n\r\nGET /metrics?x=1"
        );
        // Bare newlines and a head split across writes.
        let mut s = TcpStream::connect(&addr).unwrap();
        s.write_all(b"POST / HTTP/1.0\n").unwrap();
        std::thread::sleep(Duration::from_millis(50));
        s.write_all(b"\n").unwrap();
        let mut out = String::new();
        s.read_to_string(&mut out).unwrap();
        assert!(out.ends_with("\r\n\r\nPOST /"), "{out:?}");
    }

    #[test]
    fn a_head_over_the_limits_gets_431() {
        let addr = server();
        let long = format!("GET /{} HTTP/1.1\r\n\r\n", "a".repeat(2000));
        assert!(exchange(&addr, long.as_bytes()).starts_with("HTTP/1.1 431"));
        let many = format!(
            "GET / HTTP/1.1\r\n{}\r\n",
            "A: b\r\n".repeat(MAX_HEADERS + 1)
        );
        assert!(exchange(&addr, many.as_bytes()).starts_with("HTTP/1.1 431"));
        let fits = format!("GET / HTTP/1.1\r\n{}\r\n", "A: b\r\n".repeat(MAX_HEADERS));
        assert!(exchange(&addr, fits.as_bytes()).starts_with("HTTP/1.1 200"));
    }

    #[test]
    fn garbage_gets_400() {
        let addr = server();
        assert!(exchange(&addr, b"\x01\x02 nonsense\r\n\r\n").starts_with("HTTP/1.1 400"));
    }

    #[test]
    fn a_head_not_finished_in_time_gets_408() {
        let addr = server();
        let t0 = Instant::now();
        let a = exchange(&addr, b"GET / HTTP/1.1\r\nHost:");
        assert!(a.starts_with("HTTP/1.1 408"), "{a:?}");
        let took = t0.elapsed();
        assert!(
            took >= SHORT.head_timeout && took < Duration::from_secs(5),
            "{took:?}"
        );
    }

    #[test]
    fn connections_beyond_the_limit_get_503_at_once() {
        let addr = server();
        let held: Vec<TcpStream> = (0..SHORT.connections)
            .map(|_| TcpStream::connect(&addr).unwrap())
            .collect();
        // The held ones are accepted in order, so the next one is over the limit.
        std::thread::sleep(Duration::from_millis(100));
        let t0 = Instant::now();
        let a = exchange(&addr, b"");
        assert!(a.starts_with("HTTP/1.1 503"), "{a:?}");
        assert!(t0.elapsed() < SHORT.head_timeout);
        drop(held);
        // Their places are free again once the server has seen them go.
        let deadline = Instant::now() + Duration::from_secs(5);
        while !exchange(&addr, b"GET / HTTP/1.1\r\n\r\n").starts_with("HTTP/1.1 200") {
            assert!(Instant::now() < deadline);
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    #[test]
    fn a_dropped_slot_frees_its_place() {
        let active = Arc::new(AtomicUsize::new(0));
        let a = Slot::take(&active, 2).unwrap();
        let b = Slot::take(&active, 2).unwrap();
        assert!(Slot::take(&active, 2).is_none());
        drop(a);
        let c = Slot::take(&active, 2).unwrap();
        drop((b, c));
        assert_eq!(active.load(Ordering::Acquire), 0);
    }
}
