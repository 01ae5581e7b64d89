"""DocumentIndex: registered documents found inside a plain prompt's tokens."""

from cachetune.chunks.found import DocumentIndex, Found


def test_a_document_followed_by_its_separator_is_its_chunk_and_one_followed_by_other_text_its_body():
    index = DocumentIndex(8)
    index.add("a" * 32, [5, 6, 7, 8], [5, 6, 7, 8, 99])  # body, then the separator token 99
    whole = [1, 5, 6, 7, 8, 99, 2]
    assert index.find(whole) == [Found(1, 6, "a" * 32)]
    other = [1, 5, 6, 7, 8, 98, 98, 2]  # the separator tokenized otherwise before more text
    assert index.find(other) == [Found(1, 5, None)]


def test_documents_are_found_left_to_right_without_overlap_and_the_longest_wins():
    index = DocumentIndex(8)
    index.add("a" * 32, [5, 6], [5, 6])
    index.add("b" * 32, [5, 6, 7, 8, 9, 10, 11, 12, 13, 14], [5, 6, 7, 8, 9, 10, 11, 12, 13, 14])
    index.add("c" * 32, [20, 21, 22], [20, 21, 22])
    prompt = [0, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 20, 21, 22, 5, 6, 3]
    assert index.find(prompt) == [Found(1, 11, "b" * 32), Found(11, 14, "c" * 32), Found(14, 16, "a" * 32)]
    assert index.find([5, 7, 6, 20, 21]) == []  # partial matches are no match


def test_the_index_keeps_the_most_recent_documents_and_forgets_removed_ones():
    index = DocumentIndex(2)
    for i, start in enumerate((10, 20, 30)):
        index.add(str(i) * 32, [start, start + 1], [start, start + 1])
    assert len(index) == 2
    assert index.find([10, 11, 20, 21, 30, 31]) == [Found(2, 4, "1" * 32), Found(4, 6, "2" * 32)]
    index.remove("1" * 32)
    assert index.find([20, 21, 30, 31]) == [Found(2, 4, "2" * 32)]
