// Package e2etest holds stor's multi-process end-to-end tests. TestMain
// builds the real stor-server and stor-ctl binaries once; the tests run
// clusters of separate stor-server processes on 127.0.0.1, kill them with
// SIGKILL, restart them from their data dirs, and check what an operator
// would check, through stor-ctl and its -o json output.
//
// The package has no code outside its tests. Each server's stderr goes to a
// file in the test's temp dir and is printed with t.Log when a test fails.
// When the tests run with -race, the binaries are built with -race too, and
// a data race reported by any server fails the test.
package e2etest
