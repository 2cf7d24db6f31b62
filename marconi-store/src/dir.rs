//! A store in a local directory: one file per object.

use std::fs::{self, OpenOptions};
use std::io::{ErrorKind, Read, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use crate::error::{ConfigError, StoreError};
use crate::{check_names, Fetched, Store};

/// Temporary files start with this (object names never start with a dot).
const TMP_PREFIX: &str = ".tmp-";

/// A directory of objects, one regular file each.
///
/// Writes are atomic (a temporary file in the same directory, then a
/// rename), so a reader sees a whole old object or a whole new one; a
/// crash may leave `.tmp-*` files, which are never read. Reads are
/// bounded (at most `max_bytes + 1` bytes) and refuse anything but a
/// regular file (symlinks are not followed, FIFOs and devices are not
/// opened: the open is non-blocking and the file is checked to be the
/// regular file that was looked up). Nothing is fsynced: a torn object
/// after a power loss fails its envelope's checksum and reads as a miss.
///
/// Bound: the deadline is checked between files; one file operation on a
/// hung network filesystem cannot be interrupted (use a local disk).
#[derive(Debug)]
pub struct DirStore {
    root: PathBuf,
    timeout: Duration,
    tmp_seq: AtomicU64,
}

impl DirStore {
    /// A store in `root` (created when missing) whose calls are bounded by
    /// `timeout`.
    pub fn new(root: impl AsRef<Path>, timeout: Duration) -> Result<DirStore, ConfigError> {
        let root = root.as_ref().to_path_buf();
        if timeout.is_zero() {
            return Err(ConfigError("timeout is 0".into()));
        }
        fs::create_dir_all(&root)
            .map_err(|e| ConfigError(format!("cannot create {}: {e}", root.display())))?;
        let m = fs::metadata(&root)
            .map_err(|e| ConfigError(format!("cannot read {}: {e}", root.display())))?;
        if !m.is_dir() {
            return Err(ConfigError(format!(
                "{} is not a directory",
                root.display()
            )));
        }
        Ok(DirStore {
            root,
            timeout,
            tmp_seq: AtomicU64::new(0),
        })
    }

    /// The directory.
    pub fn root(&self) -> &Path {
        &self.root
    }

    fn deadline(&self, start: Instant) -> Result<(), StoreError> {
        if start.elapsed() > self.timeout {
            Err(StoreError::Timeout(self.timeout))
        } else {
            Ok(())
        }
    }

    fn get_one(&self, name: &str, max_bytes: usize) -> Result<Fetched, StoreError> {
        let path = self.root.join(name);
        let meta = match fs::symlink_metadata(&path) {
            Ok(m) => m,
            Err(e) if e.kind() == ErrorKind::NotFound => return Ok(Fetched::Absent),
            Err(e) => return Err(io_error(&path, &e)),
        };
        if !meta.file_type().is_file() {
            return Ok(Fetched::NotRegular);
        }
        if meta.len() > max_bytes as u64 {
            return Ok(Fetched::Oversized);
        }
        let file = match OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
            .open(&path)
        {
            Ok(f) => f,
            Err(e) if e.kind() == ErrorKind::NotFound => return Ok(Fetched::Absent),
            // ELOOP: replaced by a symlink since the lookup.
            Err(e) if e.raw_os_error() == Some(libc::ELOOP) => return Ok(Fetched::NotRegular),
            Err(e) => return Err(io_error(&path, &e)),
        };
        // The file opened may have been replaced since the lookup (a
        // concurrent put renames over it): it must still be a regular file;
        // its size is bounded by the read below.
        let fm = file.metadata().map_err(|e| io_error(&path, &e))?;
        if !fm.file_type().is_file() {
            return Ok(Fetched::NotRegular);
        }
        let mut buf = Vec::with_capacity((fm.len() as usize).min(max_bytes));
        file.take(max_bytes as u64 + 1)
            .read_to_end(&mut buf)
            .map_err(|e| io_error(&path, &e))?;
        if buf.len() > max_bytes {
            return Ok(Fetched::Oversized);
        }
        Ok(Fetched::Value(buf))
    }

    fn put_one(&self, name: &str, parts: &[&[u8]]) -> Result<(), StoreError> {
        let seq = self.tmp_seq.fetch_add(1, Ordering::Relaxed);
        let tmp = self
            .root
            .join(format!("{TMP_PREFIX}{name}-{}-{seq}", std::process::id()));
        let write = || -> std::io::Result<()> {
            let mut f = OpenOptions::new()
                .write(true)
                .create_new(true)
                .custom_flags(libc::O_NOFOLLOW)
                .open(&tmp)?;
            for p in parts {
                f.write_all(p)?;
            }
            drop(f);
            fs::rename(&tmp, self.root.join(name))
        };
        write().map_err(|e| {
            let _ = fs::remove_file(&tmp);
            io_error(&self.root.join(name), &e)
        })
    }
}

fn io_error(path: &Path, e: &std::io::Error) -> StoreError {
    StoreError::Failed(format!("{}: {e}", path.display()))
}

impl Store for DirStore {
    fn kind(&self) -> &'static str {
        "dir"
    }

    fn timeout(&self) -> Duration {
        self.timeout
    }

    fn batch_exists(&self, names: &[&str]) -> Result<Vec<bool>, StoreError> {
        check_names(names.iter().copied())?;
        let start = Instant::now();
        names
            .iter()
            .map(|n| {
                self.deadline(start)?;
                Ok(fs::symlink_metadata(self.root.join(n)).is_ok_and(|m| m.file_type().is_file()))
            })
            .collect()
    }

    fn batch_get(&self, names: &[&str], max_bytes: usize) -> Result<Vec<Fetched>, StoreError> {
        check_names(names.iter().copied())?;
        let start = Instant::now();
        names
            .iter()
            .map(|n| {
                self.deadline(start)?;
                self.get_one(n, max_bytes)
            })
            .collect()
    }

    fn batch_put(&self, items: &[(&str, &[u8])]) -> Result<(), StoreError> {
        check_names(items.iter().map(|(n, _)| *n))?;
        let start = Instant::now();
        for (n, b) in items {
            self.deadline(start)?;
            self.put_one(n, &[b])?;
        }
        Ok(())
    }

    fn batch_put_parts(&self, items: &[(&str, [&[u8]; 2])]) -> Result<(), StoreError> {
        check_names(items.iter().map(|(n, _)| *n))?;
        let start = Instant::now();
        for (n, parts) in items {
            self.deadline(start)?;
            self.put_one(n, parts)?;
        }
        Ok(())
    }

    fn delete(&self, names: &[&str]) -> Result<(), StoreError> {
        check_names(names.iter().copied())?;
        let start = Instant::now();
        for n in names {
            self.deadline(start)?;
            let path = self.root.join(n);
            match fs::symlink_metadata(&path) {
                Ok(m) if m.file_type().is_file() || m.file_type().is_symlink() => {
                    match fs::remove_file(&path) {
                        Ok(()) => {}
                        Err(e) if e.kind() == ErrorKind::NotFound => {}
                        Err(e) => return Err(io_error(&path, &e)),
                    }
                }
                // Never removes what it would not have written (a directory).
                Ok(_) => {}
                Err(e) if e.kind() == ErrorKind::NotFound => {}
                Err(e) => return Err(io_error(&path, &e)),
            }
        }
        Ok(())
    }
}
