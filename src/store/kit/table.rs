//! The rule for a configurable table name. The name is written into SQL
//! text (identifiers cannot be bound as parameters), so it is checked before
//! any statement is made from it.

use crate::store::StoreError;

/// The longest table name accepted, in bytes: the index named
/// `{table}_expires_at` then stays within PostgreSQL's 63 bytes and MySQL's
/// 64 characters for an identifier.
pub const MAX_TABLE_NAME: usize = 48;

/// `Ok` for 1 to [`MAX_TABLE_NAME`] ASCII letters, digits and underscores,
/// not starting with a digit: a name every supported database accepts
/// unquoted and the same on every platform.
///
/// # Errors
///
/// [`StoreError::Config`] naming the table and the rule.
pub fn check_table_name(table: &str) -> Result<(), StoreError> {
    let valid = !table.is_empty()
        && table.len() <= MAX_TABLE_NAME
        && !table.starts_with(|c: char| c.is_ascii_digit())
        && table.chars().all(|c| c.is_ascii_alphanumeric() || c == '_');
    if valid {
        Ok(())
    } else {
        Err(StoreError::config(format!(
            "invalid table name {table:?}: ASCII letters, digits and underscores, not starting with a digit, at most {MAX_TABLE_NAME} characters"
        )))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_inside_the_rule_pass_and_the_rest_are_config_errors() {
        for ok in ["idempotency_records", "_t", "T1", &"a".repeat(48)] {
            assert!(check_table_name(ok).is_ok(), "{ok:?}");
        }
        for bad in ["", "1t", "t-1", "t;drop", "t ", "tä", &"a".repeat(49)] {
            let e = check_table_name(bad).unwrap_err();
            assert!(matches!(e, StoreError::Config(_)), "{bad:?}: {e:?}");
            assert!(e.to_string().contains("invalid table name"), "{e}");
        }
    }
}
