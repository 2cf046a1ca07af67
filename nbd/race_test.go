//go:build race

package nbd

// raceEnabled: the race detector's shadow memory makes RSS several times
// what the program holds, so the RSS audits skip themselves under -race.
const raceEnabled = true
