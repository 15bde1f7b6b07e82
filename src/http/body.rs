//! [`Body`]: the small, complete response body of the readiness and
//! liveness services, and the JSON they write.

use std::convert::Infallible;
use std::fmt::Write as _;
use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use http_body::{Frame, SizeHint};

/// A response body known in full: one frame of bytes, or none.
///
/// Implements [`http_body::Body`] with `Data = Bytes` and no error, so
/// axum, hyper and tonic serve it as it is.
///
/// ```
/// use http_body::Body as _;
/// let body = pgwarden::http::Body::from("up\n");
/// assert_eq!(body.size_hint().exact(), Some(3));
/// ```
#[derive(Clone, Debug, Default)]
pub struct Body(Option<Bytes>);

impl Body {
    /// No bytes (what a `HEAD` request gets).
    pub(crate) fn empty() -> Body {
        Body(None)
    }
}

impl From<String> for Body {
    fn from(s: String) -> Body {
        Body::from(Bytes::from(s))
    }
}

impl From<&'static str> for Body {
    fn from(s: &'static str) -> Body {
        Body::from(Bytes::from_static(s.as_bytes()))
    }
}

impl From<Bytes> for Body {
    fn from(b: Bytes) -> Body {
        Body((!b.is_empty()).then_some(b))
    }
}

impl http_body::Body for Body {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        self: Pin<&mut Self>,
        _cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        Poll::Ready(self.get_mut().0.take().map(|b| Ok(Frame::data(b))))
    }

    fn is_end_stream(&self) -> bool {
        self.0.is_none()
    }

    fn size_hint(&self) -> SizeHint {
        SizeHint::with_exact(self.0.as_ref().map_or(0, |b| b.len() as u64))
    }
}

/// `s` as a JSON string literal, quotes included.
pub(crate) fn json_str(s: &str) -> String {
    let mut out = String::with_capacity(s.len() + 2);
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if (c as u32) < 0x20 => {
                let _ = write!(out, "\\u{:04x}", c as u32);
            }
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

/// Milliseconds with three decimals, as a JSON number.
pub(crate) fn json_ms(d: std::time::Duration) -> String {
    format!("{:.3}", d.as_secs_f64() * 1000.0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body::Body as _;

    #[test]
    fn json_strings_are_escaped() {
        assert_eq!(json_str("a\"b\\c\nd\u{1}é"), "\"a\\\"b\\\\c\\nd\\u0001é\"");
        assert_eq!(json_ms(std::time::Duration::from_micros(1500)), "1.500");
    }

    #[test]
    fn a_body_is_one_frame_then_the_end() {
        let mut b = Body::from("ready\n");
        assert_eq!(b.size_hint().exact(), Some(6));
        assert!(!b.is_end_stream());
        let waker = std::task::Waker::noop();
        let mut cx = Context::from_waker(waker);
        let frame = match Pin::new(&mut b).poll_frame(&mut cx) {
            Poll::Ready(Some(Ok(f))) => f.into_data().ok(),
            _ => None,
        };
        assert_eq!(frame.as_deref(), Some(&b"ready\n"[..]));
        assert!(b.is_end_stream());
        assert!(matches!(
            Pin::new(&mut b).poll_frame(&mut cx),
            Poll::Ready(None)
        ));
        assert_eq!(Body::empty().size_hint().exact(), Some(0));
        assert!(Body::from(String::new()).is_end_stream());
    }
}
