//! A page of a list (docs/api.md, Lists), as the edge parsed it: Stripe's `limit`,
//! `starting_after` / `ending_before` and `created[...]`, valid by type past the edge.
//!
//! Every list is ordered by `(created_at, id)`, newest first. A cursor is the id of an item the
//! list answered: the next page holds the items right after it in that order
//! ([`Cursor::After`], older) or right before it ([`Cursor::Before`], newer; still answered
//! newest first). The lists read one more item than the page holds, to tell `has_more`.

use chrono::{DateTime, Utc};

/// Items per page when `limit` is absent.
pub const DEFAULT_LIMIT: u32 = 10;
/// The largest `limit`.
pub const MAX_LIMIT: u32 = 100;

/// Which side of a known item a page is taken from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Cursor<Id> {
    /// `starting_after`: the items older than it.
    After(Id),
    /// `ending_before`: the items newer than it.
    Before(Id),
}

/// The creation times a list keeps: `from` included, `until` excluded (`created[gte]`,
/// `created[gt]`, `created[lte]`, `created[lt]`, in whole Unix seconds, come to this).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Created {
    pub from: Option<DateTime<Utc>>,
    pub until: Option<DateTime<Utc>>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PageRequest<Id> {
    limit: u32,
    pub cursor: Option<Cursor<Id>>,
    pub created: Created,
}

impl<Id> PageRequest<Id> {
    /// `limit` must be 1 ..= [`MAX_LIMIT`].
    pub fn new(limit: u32, cursor: Option<Cursor<Id>>, created: Created) -> Result<Self, String> {
        if !(1..=MAX_LIMIT).contains(&limit) {
            return Err(format!("`limit` must be between 1 and {MAX_LIMIT}"));
        }
        Ok(Self { limit, cursor, created })
    }

    /// The first page, newest first, of at most `limit` items.
    pub fn first(limit: u32) -> Result<Self, String> {
        Self::new(limit, None, Created::default())
    }

    /// The rows a list reads: one more than the page holds, to tell whether there are more.
    pub fn fetch(&self) -> i64 {
        i64::from(self.limit) + 1
    }

    /// Whether the page lies before its cursor (newer items: read oldest first, answered
    /// reversed).
    pub fn newer(&self) -> bool {
        matches!(self.cursor, Some(Cursor::Before(_)))
    }

    /// The cursor's item, either side.
    pub fn cursor_id(&self) -> Option<&Id> {
        match &self.cursor {
            Some(Cursor::After(id) | Cursor::Before(id)) => Some(id),
            None => None,
        }
    }

    /// The page from the rows read ([`PageRequest::fetch`] at most, in reading order).
    pub fn page<T>(&self, mut rows: Vec<T>) -> Page<T> {
        let limit = usize::try_from(self.limit).unwrap_or(usize::MAX);
        let has_more = rows.len() > limit;
        rows.truncate(limit);
        if self.newer() {
            rows.reverse();
        }
        Page { items: rows, has_more }
    }
}

/// A page of a list, newest first; `has_more`: more items lie beyond it in the direction it
/// was read (older after `starting_after` or with no cursor, newer before `ending_before`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Page<T> {
    pub items: Vec<T>,
    pub has_more: bool,
}

impl<T> Page<T> {
    pub fn map<U>(self, f: impl FnMut(T) -> U) -> Page<U> {
        Page {
            items: self.items.into_iter().map(f).collect(),
            has_more: self.has_more,
        }
    }

    pub fn try_map<U, E>(self, f: impl FnMut(T) -> Result<U, E>) -> Result<Page<U>, E> {
        Ok(Page {
            items: self.items.into_iter().map(f).collect::<Result<_, _>>()?,
            has_more: self.has_more,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_page_reads_one_more_than_it_holds_and_tells_there_are_more() {
        let page = PageRequest::<u8>::first(2).unwrap();
        assert_eq!(page.fetch(), 3);
        assert_eq!(
            page.page(vec![3, 2, 1]),
            Page {
                items: vec![3, 2],
                has_more: true
            }
        );
        assert_eq!(
            page.page(vec![3, 2]),
            Page {
                items: vec![3, 2],
                has_more: false
            }
        );
    }

    #[test]
    fn a_page_before_its_cursor_is_read_oldest_first_and_answered_newest_first() {
        let page = PageRequest::new(2, Some(Cursor::Before(9u8)), Created::default()).unwrap();
        assert!(page.newer());
        assert_eq!(
            page.page(vec![10, 11, 12]),
            Page {
                items: vec![11, 10],
                has_more: true
            }
        );
    }

    #[test]
    fn limits_outside_1_to_100_are_refused() {
        assert!(PageRequest::<u8>::first(0).is_err());
        assert!(PageRequest::<u8>::first(101).is_err());
        assert!(PageRequest::<u8>::first(100).is_ok());
    }
}
