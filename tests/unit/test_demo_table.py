"""The demo's final table names the model it compares with: the full softmax, or the
last model trained where `--models` leaves it out (`hsm,sampled` compared with sampled
softmax under a "vs full" header before)."""

from tf_hsm.demo import run


def _history(name, seconds, perplexities):
  return {"name": name, "params": 1000, "train_tokens": 10_000,
          "train_seconds": [seconds] * 3, "train_cpu_seconds": [2 * seconds] * 3,
          "held_out_perplexity": [500.0] + perplexities}


def _header_and_rows(histories):
  lines = run.table(histories).splitlines()
  header = [cell.strip() for cell in lines[0].strip("|").split("|")]
  rows = {line.split("|")[1].strip(): [c.strip() for c in line.strip("|").split("|")]
          for line in lines[2:]}
  return header, rows


def test_without_full_the_headers_name_the_model_compared_with():
  header, rows = _header_and_rows([_history("hsm-learned", 1.0, [120.0, 100.0]),
                                   _history("sampled-1024", 4.0, [150.0, 125.0])])
  assert not any("full" in cell for cell in header), header
  assert "speed-up over sampled-1024 (wall, CPU)" in header
  assert header[-1] == "vs sampled-1024's best"
  assert rows["hsm-learned"][5] == "4.0x, 4.0x" and rows["hsm-learned"][-1] == "-20.0%"
  assert rows["sampled-1024"][-1] == "+0.0%"


def test_with_full_the_table_is_against_full_whatever_the_order():
  header, rows = _header_and_rows([_history("full", 10.0, [100.0]),
                                   _history("hsm-two_level", 1.0, [103.0]),
                                   _history("sampled-1024", 2.0, [110.0])])
  assert header[-1] == "vs full's best" and "speed-up over full (wall, CPU)" in header
  assert rows["hsm-two_level"][5] == "10.0x, 10.0x" and rows["hsm-two_level"][-1] == "+3.0%"
