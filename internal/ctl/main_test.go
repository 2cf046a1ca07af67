package ctl

import (
	"testing"

	"github.com/stor-io/stor/internal/hangtest"
)

// A test that hangs names itself, and where it is blocked, in the last
// lines of the output, before go test's -timeout.
func TestMain(m *testing.M) { hangtest.Main(m) }
