//! The README repeats two tables of the guide (the stores, and what a client sees): each
//! must say what its guide page says, the guide's links aside.

/// The table under the line `header` in `text`, each row with its links reduced to their
/// text (`[`X`]`, `[text](target)` and `[text][label]` become `` `X` ``, `text` and `text`).
fn table(text: &str, header: &str) -> Vec<String> {
    let rows = text
        .lines()
        .skip_while(|line| *line != header)
        .take_while(|line| line.starts_with('|'));
    rows.map(without_links).collect()
}

fn without_links(line: &str) -> String {
    let mut out = String::with_capacity(line.len());
    let mut rest = line;
    while let Some(open) = rest.find('[') {
        out.push_str(&rest[..open]);
        let after = &rest[open + 1..];
        let Some(close) = after.find(']') else {
            out.push_str(&rest[open..]);
            return out;
        };
        out.push_str(&after[..close]);
        rest = &after[close + 1..];
        // An inline link's target, or a reference link's label, goes with it.
        if let Some(target) = rest.strip_prefix('(') {
            rest = target.find(')').map_or(rest, |end| &target[end + 1..]);
        } else if let Some(label) = rest.strip_prefix('[') {
            rest = label.find(']').map_or(rest, |end| &label[end + 1..]);
        }
    }
    out.push_str(rest);
    out
}

fn assert_same_table(guide: &str, header: &str) {
    let readme = table(include_str!("../README.md"), header);
    let page = table(guide, header);
    assert!(readme.len() > 3, "the README has no table under {header}");
    assert_eq!(
        readme, page,
        "the README's table under {header} differs from the guide's"
    );
}

#[test]
fn the_readme_stores_table_is_the_guides() {
    assert_same_table(
        include_str!("../src/guide/stores.md"),
        "| store | feature | for |",
    );
}

#[test]
fn the_readme_table_of_what_a_client_sees_is_the_guides() {
    assert_same_table(
        include_str!("../src/guide/error_profiles.md"),
        "| situation | status | body |",
    );
}

#[test]
fn links_are_reduced_to_their_text() {
    assert_eq!(
        without_links("| [`MemoryStore`] | see [the page](crate::guide), [the mode][mode] |"),
        "| `MemoryStore` | see the page, the mode |"
    );
}
