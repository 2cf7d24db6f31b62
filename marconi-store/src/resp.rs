//! The few RESP2 exchanges [`RedisStore`](crate::RedisStore) needs, over a
//! socket it owns, so that a whole call (connect, handshake, pipeline
//! written, every reply read) is bounded by one deadline, and a reply is
//! bounded in bytes before anything is allocated for it.
//!
//! A server that trickles its reply one byte at a time, answers garbage,
//! stalls or announces a huge value costs at most the call's deadline and
//! the bytes the caller allowed: every read and write is given what is left
//! until the deadline (never a fresh timeout of its own), and a length the
//! budget does not cover is refused before it is read.

use std::io::{self, Read, Write};
use std::net::{Shutdown, TcpStream, ToSocketAddrs};
use std::os::unix::net::UnixStream;
use std::time::{Duration, Instant};

use redis::{ConnectionAddr, ConnectionInfo};

/// A reply, as far as the store's commands need it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Reply {
    /// `+OK` and other status replies.
    Status(Vec<u8>),
    /// `:n`.
    Int(i64),
    /// `$n` (None: the null bulk string `$-1`).
    Bulk(Option<Vec<u8>>),
    /// `-ERR ...`: the server refused one command.
    Error(String),
}

/// Why an exchange failed.
#[derive(Debug)]
pub(crate) enum Failure {
    /// The deadline passed.
    Timeout,
    /// The socket failed or closed.
    Io(String),
    /// The server sent something that is not a reply to these commands, or
    /// more bytes than allowed: the stream's state is unknown.
    Protocol(String),
}

impl From<io::Error> for Failure {
    fn from(e: io::Error) -> Self {
        match e.kind() {
            io::ErrorKind::TimedOut | io::ErrorKind::WouldBlock => Failure::Timeout,
            _ => Failure::Io(e.to_string()),
        }
    }
}

enum Stream {
    Tcp(TcpStream),
    Unix(UnixStream),
}

impl Stream {
    fn set_timeouts(&self, t: Duration) -> io::Result<()> {
        match self {
            Stream::Tcp(s) => {
                s.set_read_timeout(Some(t))?;
                s.set_write_timeout(Some(t))
            }
            Stream::Unix(s) => {
                s.set_read_timeout(Some(t))?;
                s.set_write_timeout(Some(t))
            }
        }
    }

    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match self {
            Stream::Tcp(s) => s.read(buf),
            Stream::Unix(s) => s.read(buf),
        }
    }

    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        match self {
            Stream::Tcp(s) => s.write(buf),
            Stream::Unix(s) => s.write(buf),
        }
    }
}

impl Drop for Stream {
    fn drop(&mut self) {
        let _ = match self {
            Stream::Tcp(s) => s.shutdown(Shutdown::Both),
            Stream::Unix(s) => s.shutdown(Shutdown::Both),
        };
    }
}

/// What is left until `deadline`, or a timeout when nothing is.
fn left(deadline: Instant) -> Result<Duration, Failure> {
    let now = Instant::now();
    if now >= deadline {
        return Err(Failure::Timeout);
    }
    // A zero socket timeout means "none": never pass one.
    Ok((deadline - now).max(Duration::from_millis(1)))
}

/// Appends one command (an array of bulk strings; each argument given in
/// parts, written one after the other) to `out`.
pub(crate) fn command(out: &mut Vec<u8>, args: &[&[&[u8]]]) {
    out.extend_from_slice(format!("*{}\r\n", args.len()).as_bytes());
    for parts in args {
        let len: usize = parts.iter().map(|p| p.len()).sum();
        out.extend_from_slice(format!("${len}\r\n").as_bytes());
        for p in *parts {
            out.extend_from_slice(p);
        }
        out.extend_from_slice(b"\r\n");
    }
}

/// The longest status, error or integer line accepted.
const MAX_LINE: usize = 4096;

/// One connection.
pub(crate) struct Conn {
    stream: Stream,
    buf: Vec<u8>,
    start: usize,
}

impl Conn {
    /// Connects to `info` and runs its handshake (AUTH, SELECT), all
    /// before `deadline`.
    pub(crate) fn open(info: &ConnectionInfo, deadline: Instant) -> Result<Conn, Failure> {
        let stream = match &info.addr {
            ConnectionAddr::Tcp(host, port) => {
                let mut last = Failure::Io(format!("{host}:{port} resolves to no address"));
                let mut found = None;
                for a in (host.as_str(), *port).to_socket_addrs()? {
                    match TcpStream::connect_timeout(&a, left(deadline)?) {
                        Ok(s) => {
                            found = Some(s);
                            break;
                        }
                        Err(e) => last = e.into(),
                    }
                }
                let s = found.ok_or(last)?;
                let _ = s.set_nodelay(true);
                Stream::Tcp(s)
            }
            ConnectionAddr::Unix(path) => Stream::Unix(UnixStream::connect(path)?),
            ConnectionAddr::TcpTls { .. } => {
                return Err(Failure::Io("TLS (rediss://) is not supported".into()))
            }
        };
        let mut c = Conn {
            stream,
            buf: Vec::new(),
            start: 0,
        };
        let r = &info.redis;
        let mut out = Vec::new();
        let mut n = 0;
        if let Some(pw) = &r.password {
            match &r.username {
                Some(u) => command(&mut out, &[&[b"AUTH"], &[u.as_bytes()], &[pw.as_bytes()]]),
                None => command(&mut out, &[&[b"AUTH"], &[pw.as_bytes()]]),
            }
            n += 1;
        }
        if r.db != 0 {
            command(&mut out, &[&[b"SELECT"], &[r.db.to_string().as_bytes()]]);
            n += 1;
        }
        if n > 0 {
            for reply in c.exchange(&out, n, 64 * n, deadline)? {
                match reply {
                    Reply::Status(_) => {}
                    Reply::Error(e) => return Err(Failure::Io(format!("handshake refused: {e}"))),
                    r => return Err(Failure::Protocol(format!("handshake reply {r:?}"))),
                }
            }
        }
        Ok(c)
    }

    /// Writes `request` (`n` commands) and reads their `n` replies, all
    /// before `deadline` and in at most `max_reply_bytes` bytes of replies.
    pub(crate) fn exchange(
        &mut self,
        request: &[u8],
        n: usize,
        max_reply_bytes: usize,
        deadline: Instant,
    ) -> Result<Vec<Reply>, Failure> {
        let mut sent = 0;
        while sent < request.len() {
            self.stream.set_timeouts(left(deadline)?)?;
            match self.stream.write(&request[sent..]) {
                Ok(0) => return Err(Failure::Io("the server closed the connection".into())),
                Ok(k) => sent += k,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e.into()),
            }
        }
        let mut budget = max_reply_bytes;
        let mut out = Vec::with_capacity(n);
        for _ in 0..n {
            out.push(self.reply(&mut budget, deadline)?);
        }
        Ok(out)
    }

    /// Reads more bytes into the buffer (at least one), before `deadline`.
    fn fill(&mut self, budget: &mut usize, deadline: Instant) -> Result<(), Failure> {
        if self.start > 0 {
            self.buf.drain(..self.start);
            self.start = 0;
        }
        let mut chunk = [0u8; 16 * 1024];
        loop {
            self.stream.set_timeouts(left(deadline)?)?;
            match self.stream.read(&mut chunk) {
                Ok(0) => return Err(Failure::Io("the server closed the connection".into())),
                Ok(k) => {
                    if k > *budget {
                        return Err(Failure::Protocol(
                            "the reply is larger than the values asked for".into(),
                        ));
                    }
                    *budget -= k;
                    self.buf.extend_from_slice(&chunk[..k]);
                    return Ok(());
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e.into()),
            }
        }
    }

    /// One line without its CRLF.
    fn line(&mut self, budget: &mut usize, deadline: Instant) -> Result<Vec<u8>, Failure> {
        let mut scanned = self.start;
        loop {
            if let Some(i) = self.buf[scanned..].windows(2).position(|w| w == b"\r\n") {
                let end = scanned + i;
                let line = self.buf[self.start..end].to_vec();
                self.start = end + 2;
                return Ok(line);
            }
            scanned = self.buf.len().saturating_sub(1).max(self.start);
            if self.buf.len() - self.start > MAX_LINE {
                return Err(Failure::Protocol("a reply line is too long".into()));
            }
            let before = self.start;
            self.fill(budget, deadline)?;
            // `fill` moved the unread bytes to the front.
            scanned -= before;
        }
    }

    fn reply(&mut self, budget: &mut usize, deadline: Instant) -> Result<Reply, Failure> {
        let line = self.line(budget, deadline)?;
        let (&kind, rest) = line
            .split_first()
            .ok_or_else(|| Failure::Protocol("an empty reply line".into()))?;
        let text = || String::from_utf8_lossy(rest).into_owned();
        let int = || -> Result<i64, Failure> {
            std::str::from_utf8(rest)
                .ok()
                .and_then(|s| s.parse::<i64>().ok())
                .ok_or_else(|| Failure::Protocol(format!("not an integer: {:?}", text())))
        };
        match kind {
            b'+' => Ok(Reply::Status(rest.to_vec())),
            b'-' => Ok(Reply::Error(text())),
            b':' => Ok(Reply::Int(int()?)),
            b'$' => {
                let n = int()?;
                if n == -1 {
                    return Ok(Reply::Bulk(None));
                }
                let n = usize::try_from(n)
                    .map_err(|_| Failure::Protocol(format!("a bulk length of {n}")))?;
                let want = n
                    .checked_add(2)
                    .ok_or_else(|| Failure::Protocol("a bulk length that overflows".into()))?;
                // Refused before reading or allocating it: the budget is
                // what the values asked for can take.
                if want > (self.buf.len() - self.start) + *budget {
                    return Err(Failure::Protocol(format!(
                        "a bulk reply of {n} bytes is larger than the values asked for"
                    )));
                }
                while self.buf.len() - self.start < want {
                    self.fill(budget, deadline)?;
                }
                let body = self.buf[self.start..self.start + n].to_vec();
                if &self.buf[self.start + n..self.start + want] != b"\r\n" {
                    return Err(Failure::Protocol("a bulk reply without its CRLF".into()));
                }
                self.start += want;
                Ok(Reply::Bulk(Some(body)))
            }
            k => Err(Failure::Protocol(format!(
                "a reply of type {:?} to these commands",
                k as char
            ))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::command;

    #[test]
    fn commands_are_arrays_of_bulk_strings() {
        let mut out = Vec::new();
        command(&mut out, &[&[b"SET"], &[b"k"], &[b"ab", b"c"]]);
        assert_eq!(out, b"*3\r\n$3\r\nSET\r\n$1\r\nk\r\n$3\r\nabc\r\n");
    }
}
