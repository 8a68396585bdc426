#!/usr/bin/env python3
"""Host tests of judge.py on made-up console logs (run by `make check`: host-test)."""
import os
import signal
import sys
import tempfile
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import judge  # noqa: E402

NAMES = [f"some_guest_test_number_{i}" for i in range(700)]


def judged(text, expect_suites=()):
    with tempfile.NamedTemporaryFile("w", suffix=".log", delete=False) as f:
        f.write(text)
    res = {"pass": [], "fail": [], "cargo_pass": 0, "cargo_fail": 0}
    try:
        judge.judge_console(f.name, list(expect_suites), res)
    finally:
        os.unlink(f.name)
    return res


def results(names, end="[   99.000000] GMEM-RUN-END\n"):
    return "".join(f"[   50.000000] GMEM-UTEST ok {n}\n" for n in names) + end


class Plan(unittest.TestCase):
    def setUp(self):
        # A regression to a backtracking pattern must fail here, not hang CI.
        signal.signal(signal.SIGALRM, self.too_slow)
        signal.alarm(60)

    @staticmethod
    def too_slow(*_):
        raise TimeoutError("the judge took over 60 s on one log (backtracking pattern?)")

    def tearDown(self):
        signal.alarm(0)

    def test_plan_with_a_kernel_message_glued_to_its_end(self):
        log = ("GMEM-UTEST-PLAN " + " ".join(NAMES) + "[    3.141592] random: crng init done\n"
               + results(NAMES))
        res = judged(log)
        self.assertEqual(res["fail"], [])
        self.assertEqual(len(res["pass"]), len(NAMES))

    def test_plan_in_several_records(self):
        plan = "".join(f"[    2.000000] GMEM-UTEST-PLAN {' '.join(NAMES[i:i + 30])}\n"
                       for i in range(0, len(NAMES), 30))
        self.assertEqual(judged(plan + results(NAMES))["fail"], [])
        res = judged(plan + results(NAMES[:-1]))
        self.assertEqual(res["fail"], [(f"guest/{NAMES[-1]}",
                                        "planned but never reported (test runner died?)")])

    def test_two_plans_on_one_line(self):
        log = ("GMEM-UTEST-PLAN x[    1.000000] GMEM-UTEST-PLAN a b\n"
               + results(["x", "a"]))
        res = judged(log)
        self.assertEqual(res["fail"], [("guest/b", "planned but never reported (test runner died?)")])

    def test_no_end_marker_fails(self):
        res = judged("GMEM-UTEST-PLAN a b\n" + results(["a", "b"], end=""))
        self.assertEqual([n for n, _ in res["fail"]], ["guest"])


class Reports(unittest.TestCase):
    def test_failure_and_kernel_report(self):
        log = ("GMEM-UTEST-PLAN a b\nGMEM-UTEST ok a\nGMEM-UTEST not ok b # FILL: Errno(12)\n"
               "[   10.000000] BUG: unable to handle page fault\nGMEM-RUN-END\n")
        res = judged(log)
        self.assertEqual(res["pass"], ["guest/a"])
        self.assertIn(("guest/b", "FILL: Errno(12)"), res["fail"])
        self.assertIn("kernel BUG", [n for n, _ in res["fail"]])

    def test_result_glued_behind_other_console_text(self):
        res = judged("GMEM-UTEST-PLAN a\nsome output[    1.000000] GMEM-UTEST ok a\nGMEM-RUN-END\n")
        self.assertEqual((res["pass"], res["fail"]), (["guest/a"], []))

    def test_kunit_suite(self):
        log = ("    # Subtest: gmem_policy\n    1..2\n    ok 1 first\n    not ok 2 second\n"
               "not ok 1 gmem_policy\nGMEM-RUN-END\n")
        res = judged(log, ["gmem_policy", "gmem_missing"])
        self.assertEqual(res["pass"], ["kunit/gmem_policy.first"])
        self.assertEqual([n for n, _ in res["fail"]],
                         ["kunit/gmem_policy.second", "kunit/gmem_policy", "kunit/gmem_missing"])


if __name__ == "__main__":
    unittest.main()
