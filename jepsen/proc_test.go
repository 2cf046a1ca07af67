package jepsen

import "testing"

func TestDeployedGODEBUGKeepsTheCallersSettings(t *testing.T) {
	for _, tc := range []struct{ callers, want string }{
		{"", "GODEBUG=schedtrace=2147483647"},
		{"madvdontneed=1", "GODEBUG=madvdontneed=1,schedtrace=2147483647"},
		{"schedtrace=0", "GODEBUG=schedtrace=0"},
		{"gctrace=1,schedtrace=1000", "GODEBUG=gctrace=1,schedtrace=1000"},
		{"xschedtrace=1", "GODEBUG=xschedtrace=1,schedtrace=2147483647"},
	} {
		if got := deployedGODEBUG(tc.callers); got != tc.want {
			t.Errorf("deployedGODEBUG(%q) = %q, want %q", tc.callers, got, tc.want)
		}
	}
}
