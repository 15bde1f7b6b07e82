//! Human output: aligned tables, durations in human units, timestamps.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// An aligned table: a header row, then rows; columns separated by two
/// spaces, each as wide as its widest cell (counted in characters).
pub(crate) fn table(header: &[&str], rows: &[Vec<String>]) -> String {
    let mut widths: Vec<usize> = header.iter().map(|h| h.chars().count()).collect();
    for row in rows {
        for (i, cell) in row.iter().enumerate() {
            if let Some(w) = widths.get_mut(i) {
                *w = (*w).max(cell.chars().count());
            }
        }
    }
    let mut out = String::new();
    let mut line = |cells: &mut dyn Iterator<Item = &str>| {
        let mut s = String::new();
        for (i, cell) in cells.enumerate() {
            if i > 0 {
                s.push_str("  ");
            }
            s.push_str(cell);
            let pad = widths[i].saturating_sub(cell.chars().count());
            s.extend(std::iter::repeat_n(' ', pad));
        }
        out.push_str(s.trim_end());
        out.push('\n');
    };
    line(&mut header.iter().copied());
    for row in rows {
        line(&mut row.iter().map(String::as_str));
    }
    out
}

/// A duration in its two largest units: `850ms`, `42s`, `5m 3s`, `2h 11m`,
/// `3d 4h`.
pub(crate) fn human(d: Duration) -> String {
    let s = d.as_secs();
    let (days, h, m, sec) = (s / 86_400, s / 3600 % 24, s / 60 % 60, s % 60);
    if days > 0 {
        format!("{days}d {h}h")
    } else if h > 0 {
        format!("{h}h {m}m")
    } else if m > 0 {
        format!("{m}m {sec}s")
    } else if s > 0 {
        format!("{s}s")
    } else {
        format!("{}ms", d.as_millis())
    }
}

/// Signed seconds as a human duration: `in 42s`, `42s ago`.
pub(crate) fn human_signed(secs: f64) -> String {
    let d = Duration::try_from_secs_f64(secs.abs()).unwrap_or_default();
    if secs >= 0.0 {
        format!("in {}", human(d))
    } else {
        format!("{} ago", human(d))
    }
}

/// A time as RFC 3339 in UTC, to the millisecond: `2026-12-01T15:04:22.123Z`.
pub(crate) fn rfc3339(t: SystemTime) -> String {
    let (secs, millis) = match t.duration_since(UNIX_EPOCH) {
        Ok(d) => (d.as_secs() as i64, d.subsec_millis()),
        Err(e) => {
            let d = e.duration();
            let ms = d.as_millis() as i64;
            (-(ms + 999) / 1000, ((1000 - ms % 1000) % 1000) as u32)
        }
    };
    let (days, rem) = (secs.div_euclid(86_400), secs.rem_euclid(86_400));
    let (y, mo, d) = civil_from_days(days);
    format!(
        "{y:04}-{mo:02}-{d:02}T{:02}:{:02}:{:02}.{millis:03}Z",
        rem / 3600,
        rem / 60 % 60,
        rem % 60
    )
}

/// Days since 1970-01-01 to (year, month, day) in the proleptic Gregorian
/// calendar (Howard Hinnant's `civil_from_days`).
fn civil_from_days(z: i64) -> (i64, u32, u32) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let y = yoe + era * 400;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    (if m <= 2 { y + 1 } else { y }, m, d)
}

/// Parses a duration: `250ms`, `10s`, `5m`, `2h`, `1h30m`, `1d`, or a bare
/// number of seconds (`1.5`).
pub(crate) fn parse_duration(s: &str) -> Result<Duration, String> {
    let t = s.trim();
    let bad = || {
        format!("invalid duration {s:?}: write a number and a unit, e.g. 500ms, 30s, 5m, 2h, 1h30m")
    };
    if t.is_empty() {
        return Err(bad());
    }
    if let Ok(secs) = t.parse::<f64>() {
        return Duration::try_from_secs_f64(secs).map_err(|_| bad());
    }
    let mut total = Duration::ZERO;
    let mut rest = t;
    while !rest.is_empty() {
        let num_len = rest
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .ok_or_else(bad)?;
        let (num, tail) = rest.split_at(num_len);
        let unit_len = tail
            .find(|c: char| c.is_ascii_digit() || c == '.')
            .unwrap_or(tail.len());
        let (unit, tail) = tail.split_at(unit_len);
        let n: f64 = num.parse().map_err(|_| bad())?;
        let scale = match unit {
            "ms" => 0.001,
            "s" => 1.0,
            "m" | "min" => 60.0,
            "h" => 3600.0,
            "d" => 86_400.0,
            _ => return Err(bad()),
        };
        total += Duration::try_from_secs_f64(n * scale).map_err(|_| bad())?;
        rest = tail;
    }
    Ok(total)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_read_and_print() {
        assert_eq!(parse_duration("60s"), Ok(Duration::from_secs(60)));
        assert_eq!(parse_duration("250ms"), Ok(Duration::from_millis(250)));
        assert_eq!(parse_duration("1h30m"), Ok(Duration::from_secs(5400)));
        assert_eq!(parse_duration("1.5"), Ok(Duration::from_millis(1500)));
        assert_eq!(parse_duration("0s"), Ok(Duration::ZERO));
        for bad in ["", "s", "10x", "-1s", "1e400", "5 m"] {
            assert!(parse_duration(bad).is_err(), "{bad}");
        }
        assert_eq!(human(Duration::from_secs(2 * 3600 + 11 * 60 + 5)), "2h 11m");
        assert_eq!(human(Duration::from_secs(303)), "5m 3s");
        assert_eq!(human(Duration::from_millis(850)), "850ms");
        assert_eq!(human_signed(-42.2), "42s ago");
    }

    #[test]
    fn timestamps_are_rfc3339_utc() {
        let t = UNIX_EPOCH + Duration::from_millis(1_796_137_462_123);
        assert_eq!(rfc3339(t), "2026-12-01T15:04:22.123Z");
        assert_eq!(rfc3339(UNIX_EPOCH), "1970-01-01T00:00:00.000Z");
        assert_eq!(
            rfc3339(UNIX_EPOCH - Duration::from_millis(1)),
            "1969-12-31T23:59:59.999Z"
        );
    }

    #[test]
    fn tables_align() {
        let t = table(
            &["NAME", "PID"],
            &[
                vec!["a".into(), "1".into()],
                vec!["long".into(), "22".into()],
            ],
        );
        assert_eq!(t, "NAME  PID\na     1\nlong  22\n");
    }
}
