//! The envelope every value is stored in, and its verification.
//!
//! Layout (little endian), [`HEADER_LEN`] bytes then the payload:
//!
//! | bytes  | field                                                  |
//! |--------|--------------------------------------------------------|
//! | 0..8   | magic `MRCNSTOR`                                       |
//! | 8..10  | envelope format version ([`FORMAT_VERSION`])           |
//! | 10     | key kind (1 KV block, 2 state)                         |
//! | 11     | reserved, 0                                            |
//! | 12..16 | value layout version (the engine's)                    |
//! | 16..48 | model/layout fingerprint                               |
//! | 48..80 | digest of the key the value was written under          |
//! | 80..88 | payload length                                         |
//! | 88..96 | XXH3-64 of the payload seeded with XXH3-64 of 0..88    |
//!
//! Checks run cheapest first and the first failure names the miss:
//! truncated (shorter than a header or than its length says), corrupt (bad
//! magic, trailing bytes, checksum), version (another format or layout
//! version), foreign model, wrong key (a value copied or swapped between
//! keys). A value passes only when every field matches what the reader
//! expects and the checksum holds.

use xxhash_rust::xxh3::{xxh3_64, xxh3_64_with_seed};

use crate::key::{Fingerprint, KeyKind, StoreKey};

/// The first bytes of every envelope.
pub const MAGIC: [u8; 8] = *b"MRCNSTOR";
/// The envelope format this library writes and reads.
pub const FORMAT_VERSION: u16 = 1;
/// Bytes before the payload.
pub const HEADER_LEN: usize = 96;

/// What a reader expects of a value (and what a writer seals into it).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Expect {
    /// The key the value is read (or written) under.
    pub key: StoreKey,
    /// The model/layout fingerprint.
    pub fingerprint: Fingerprint,
    /// The engine's value layout version.
    pub layout_version: u32,
}

/// Why an envelope was refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Refusal {
    /// Shorter than its header or than the length it declares.
    Truncated,
    /// Bad magic, trailing bytes, unknown kind or reserved byte, or a
    /// checksum that does not match.
    Corrupt,
    /// Another envelope format or value layout version.
    Version,
    /// Written by another model or layout.
    ForeignModel,
    /// Written under another key.
    WrongKey,
}

fn header(e: &Expect, len: u64) -> [u8; HEADER_LEN] {
    let mut h = [0u8; HEADER_LEN];
    h[0..8].copy_from_slice(&MAGIC);
    h[8..10].copy_from_slice(&FORMAT_VERSION.to_le_bytes());
    h[10] = e.key.kind as u8;
    h[12..16].copy_from_slice(&e.layout_version.to_le_bytes());
    h[16..48].copy_from_slice(&e.fingerprint.0);
    h[48..80].copy_from_slice(&e.key.digest);
    h[80..88].copy_from_slice(&len.to_le_bytes());
    h
}

/// The checksum of an envelope: XXH3-64 of the payload, seeded with the
/// XXH3-64 of the header's first 88 bytes (one pass over the payload).
fn checksum(head: &[u8], payload: &[u8]) -> u64 {
    xxh3_64_with_seed(payload, xxh3_64(head))
}

/// The sealed header of `payload`'s envelope for `e` (the envelope is this
/// header followed by the payload): one hashing pass, no copy, for stores
/// that write the two parts one after the other.
pub fn seal_header(e: &Expect, payload: &[u8]) -> [u8; HEADER_LEN] {
    let mut h = header(e, payload.len() as u64);
    let sum = checksum(&h[..88], payload);
    h[88..96].copy_from_slice(&sum.to_le_bytes());
    h
}

/// The envelope of `payload` for `e`: header then payload, sealed with the
/// checksum.
pub fn seal(e: &Expect, payload: &[u8]) -> Vec<u8> {
    let h = seal_header(e, payload);
    let mut out = Vec::with_capacity(HEADER_LEN + payload.len());
    out.extend_from_slice(&h);
    out.extend_from_slice(payload);
    out
}

/// Verifies `bytes` against `e` and returns the payload's range in it.
pub fn open(e: &Expect, bytes: &[u8]) -> Result<std::ops::Range<usize>, Refusal> {
    let Some(h) = bytes.get(..HEADER_LEN) else {
        return Err(Refusal::Truncated);
    };
    if h[0..8] != MAGIC {
        return Err(Refusal::Corrupt);
    }
    let le32 = |r: std::ops::Range<usize>| {
        let mut b = [0u8; 4];
        b.copy_from_slice(&h[r]);
        u32::from_le_bytes(b)
    };
    let le64 = |r: std::ops::Range<usize>| {
        let mut b = [0u8; 8];
        b.copy_from_slice(&h[r]);
        u64::from_le_bytes(b)
    };
    let len = le64(80..88);
    let body = (bytes.len() - HEADER_LEN) as u64;
    if body < len {
        return Err(Refusal::Truncated);
    }
    if body > len || KeyKind::from_u8(h[10]).is_none() || h[11] != 0 {
        return Err(Refusal::Corrupt);
    }
    if checksum(&h[..88], &bytes[HEADER_LEN..]) != le64(88..96) {
        return Err(Refusal::Corrupt);
    }
    // The header is intact: what remains is whether it is ours.
    if u16::from_le_bytes([h[8], h[9]]) != FORMAT_VERSION || le32(12..16) != e.layout_version {
        return Err(Refusal::Version);
    }
    if h[16..48] != e.fingerprint.0 {
        return Err(Refusal::ForeignModel);
    }
    if h[10] != e.key.kind as u8 || h[48..80] != e.key.digest {
        return Err(Refusal::WrongKey);
    }
    Ok(HEADER_LEN..bytes.len())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn expect(d: u8) -> Expect {
        Expect {
            key: StoreKey {
                kind: KeyKind::State,
                digest: [d; 32],
            },
            fingerprint: Fingerprint::of("m"),
            layout_version: 3,
        }
    }

    #[test]
    fn round_trip_and_every_refusal() {
        let e = expect(1);
        let payload: Vec<u8> = (0..200_000u32).map(|i| (i * 7) as u8).collect();
        let sealed = seal(&e, &payload);
        assert_eq!(sealed.len(), HEADER_LEN + payload.len());
        assert_eq!(&sealed[open(&e, &sealed).unwrap()], &payload[..]);
        assert_eq!(seal_header(&e, &payload)[..], sealed[..HEADER_LEN]);
        assert_eq!(open(&e, &seal(&e, &[])), Ok(HEADER_LEN..HEADER_LEN));

        assert_eq!(open(&e, &sealed[..50]), Err(Refusal::Truncated));
        assert_eq!(
            open(&e, &sealed[..sealed.len() - 1]),
            Err(Refusal::Truncated)
        );
        let mut longer = sealed.clone();
        longer.push(0);
        assert_eq!(open(&e, &longer), Err(Refusal::Corrupt));
        for at in [0, 10, 11, 20, 60, 85, 90, HEADER_LEN, sealed.len() - 1] {
            let mut c = sealed.clone();
            c[at] ^= 0x40;
            let want = if (80..88).contains(&at) {
                Err(Refusal::Truncated) // the length now says more than there is
            } else {
                Err(Refusal::Corrupt)
            };
            assert_eq!(open(&e, &c), want, "byte {at}");
        }
        assert_eq!(open(&expect(2), &sealed), Err(Refusal::WrongKey));
        let mut kv = e;
        kv.key.kind = KeyKind::Kv;
        assert_eq!(open(&kv, &sealed), Err(Refusal::WrongKey));
        let mut other = e;
        other.fingerprint = Fingerprint::of("m2");
        assert_eq!(open(&other, &sealed), Err(Refusal::ForeignModel));
        let mut v = e;
        v.layout_version = 4;
        assert_eq!(open(&v, &sealed), Err(Refusal::Version));
    }
}
