//! Byte sizes written by people: `5GB` (10^9), `5GiB` (2^30), `512MiB`,
//! `1.5TB`, `123456` (bytes).

/// Parses a capacity: a number, optional spaces, an optional unit among
/// B, KB, MB, GB, TB (powers of 1000) and KiB, MiB, GiB, TiB (powers of
/// 1024), case-insensitive for the prefix letter.
pub fn parse_bytes(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.' || c == 'e' || c == 'E' || c == '_'))
        .unwrap_or(t.len());
    // An exponent 'e' directly followed by a unit letter is ambiguous; units
    // never start with 'e', so this split is safe.
    let (num, unit) = t.split_at(split);
    let num: f64 = num
        .replace('_', "")
        .parse()
        .map_err(|_| format!("{s:?}: expected a number followed by a unit such as GB or GiB"))?;
    let mult: f64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1.0,
        "kb" | "k" => 1e3,
        "mb" | "m" => 1e6,
        "gb" | "g" => 1e9,
        "tb" | "t" => 1e12,
        "kib" => 1024.0,
        "mib" => 1024.0 * 1024.0,
        "gib" => 1024.0 * 1024.0 * 1024.0,
        "tib" => 1024.0f64.powi(4),
        u => {
            return Err(format!(
                "{s:?}: unknown unit {u:?} (B, KB, MB, GB, TB, KiB, MiB, GiB, TiB)"
            ))
        }
    };
    let b = num * mult;
    if !b.is_finite() || b < 0.0 || b >= u64::MAX as f64 {
        return Err(format!("{s:?}: out of range"));
    }
    Ok(b.round() as u64)
}

/// Formats bytes with a decimal unit (`5 GB`, `512 MB`), 3 significant digits.
pub fn format_bytes(b: u64) -> String {
    if b == u64::MAX {
        return "unbounded".into();
    }
    let units = [("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3)];
    for (u, m) in units {
        if b as f64 >= m {
            let x = b as f64 / m;
            return if x >= 100.0 || x.fract() == 0.0 {
                format!("{x:.0} {u}")
            } else if x >= 10.0 {
                format!("{x:.1} {u}")
            } else {
                format!("{x:.2} {u}")
            };
        }
    }
    format!("{b} B")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn units() {
        assert_eq!(parse_bytes("5GB"), Ok(5_000_000_000));
        assert_eq!(parse_bytes("5 GB"), Ok(5_000_000_000));
        assert_eq!(parse_bytes("5GiB"), Ok(5 << 30));
        assert_eq!(parse_bytes("512MiB"), Ok(512 << 20));
        assert_eq!(parse_bytes("1.5TB"), Ok(1_500_000_000_000));
        assert_eq!(parse_bytes("123456"), Ok(123_456));
        assert_eq!(parse_bytes("5e9"), Ok(5_000_000_000));
        assert_eq!(parse_bytes("10_000b"), Ok(10_000));
        assert!(parse_bytes("5 GX").unwrap_err().contains("unknown unit"));
        assert!(parse_bytes("GB").is_err());
        assert!(parse_bytes("-1GB").is_err());
        assert_eq!(format_bytes(5_000_000_000), "5 GB");
        assert_eq!(format_bytes(1_250_000_000), "1.25 GB");
        assert_eq!(format_bytes(999), "999 B");
    }
}
