//! `Retry-After` (RFC 9110 §10.2.3): delay-seconds or an HTTP-date.

use std::time::{Duration, SystemTime};

use http::HeaderValue;

/// How long `value` asks a client to wait, read at `now`: a number of seconds, or an
/// HTTP-date (a date already past is no wait). `None` for anything else; the caller then
/// relies on its backoff alone.
pub(crate) fn parse(value: &HeaderValue, now: SystemTime) -> Option<Duration> {
    let text = value.to_str().ok()?.trim();
    if !text.is_empty() && text.bytes().all(|b| b.is_ascii_digit()) {
        // Too many digits for a u64 is still "a very long time".
        return Some(Duration::from_secs(text.parse().unwrap_or(u64::MAX)));
    }
    let date = httpdate::parse_http_date(text).ok()?;
    Some(date.duration_since(now).unwrap_or(Duration::ZERO))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(value: &'static str, now: SystemTime) -> Option<Duration> {
        parse(&HeaderValue::from_static(value), now)
    }

    fn secs(s: u64) -> Option<Duration> {
        Some(Duration::from_secs(s))
    }

    #[test]
    fn delay_seconds() {
        let now = SystemTime::now();
        assert_eq!(at("0", now), secs(0));
        assert_eq!(at("3", now), secs(3));
        assert_eq!(at(" 120 ", now), secs(120));
        assert_eq!(at("99999999999999999999999", now), secs(u64::MAX));
    }

    #[test]
    fn http_dates_in_each_format_rfc_9110_allows() {
        // Sun, 06 Nov 1994 08:49:37 GMT
        let date = SystemTime::UNIX_EPOCH + Duration::from_secs(784_111_777);
        let now = date - Duration::from_secs(90);
        assert_eq!(at("Sun, 06 Nov 1994 08:49:37 GMT", now), secs(90));
        assert_eq!(at("Sunday, 06-Nov-94 08:49:37 GMT", now), secs(90));
        assert_eq!(at("Sun Nov  6 08:49:37 1994", now), secs(90));
        // A date in the past asks for no wait.
        let later = date + Duration::from_secs(5);
        assert_eq!(at("Sun, 06 Nov 1994 08:49:37 GMT", later), secs(0));
    }

    #[test]
    fn garbage_is_no_hint() {
        let now = SystemTime::now();
        for value in [
            "",
            "soon",
            "-1",
            "1.5",
            "3s",
            "0x10",
            "Sun, 32 Nov 1994 08:49:37 GMT",
        ] {
            assert_eq!(at(value, now), None, "{value:?}");
        }
        let binary = HeaderValue::from_bytes(b"\xff1").unwrap();
        assert_eq!(parse(&binary, now), None);
    }
}
