"""The Lee corpus is fetched from the pinned gensim wheel and checked."""

from server.tools.corpus import FILE_NAME, lee_corpus_path


def test_corpus_is_extracted_verified_and_reused(tmp_path):
    path = lee_corpus_path(tmp_path)
    assert path == tmp_path / FILE_NAME
    text = path.read_text(encoding="utf-8")
    assert text.startswith("Hundreds of people have been forced to vacate their homes")
    assert len(text) == 360082 and len(text.split()) > 50_000
    mtime = path.stat().st_mtime_ns
    assert lee_corpus_path(tmp_path).stat().st_mtime_ns == mtime  # second call reuses the file


def test_a_damaged_copy_is_replaced(tmp_path):
    (tmp_path / FILE_NAME).write_text("truncated")
    assert lee_corpus_path(tmp_path).read_text(encoding="utf-8").startswith("Hundreds of people")
